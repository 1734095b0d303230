"""`[parallel] profile = "auto"`: measure the pool's configs on this job's own device before training.

The profile (`hydraulis profile`'s machinery) covers this job's device,
dtype, world size and document lengths, and is cached as `profile.json` in
the run directory; a resume or rerun reuses it when model, configs, device,
dtype, world size and sweep match, and profiles again otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hydraulis.checkpoints import Log
from hydraulis.config import RunConfig
from hydraulis.cost.sweep import ProfileSettings
from hydraulis.errors import HydraulisError
from hydraulis.jsonio import read_json_object
from hydraulis.parallel import ParallelConfig
from hydraulis.progress import say
from hydraulis.specs import ModelSpec

AUTO_PROFILE = "profile.json"  # the measured profile, cached in the run directory


def _sweep_for(max_len: int, lengths: np.ndarray) -> dict[str, Any]:
    """The sweep of profile = "auto": the documents this job trains, from its 10th percentile up to max_len.

    Why: a, b, c are fitted where the planner will use them. Below the data's
    short tail, per-document overheads the model has no term for would pull
    the fit (and under-predict the long documents that set iteration times).
    Powers of two: the longest is max_len rounded up (at least 256), the shortest
    at least 128 and at most a quarter of it (three sizes to separate a from b);
    totals up to two of the longest.
    """
    top = 1 << max(8, (max_len - 1).bit_length())
    tenth = int(np.percentile(lengths, 10)) if len(lengths) else 128
    low = min(max(128, 1 << max(0, tenth.bit_length() - 1)), max(128, top // 4))
    totals = tuple(1 << k for k in range(low.bit_length() - 1, top.bit_length() + 1))
    return {"totals": totals, "min_doc": low, "max_doc": top}


@dataclass(frozen=True)
class AutoProfile:
    """`profile = "auto"`: these configs of this model, measured on this job's device, dtype and world size."""

    spec: ModelSpec
    configs: tuple[ParallelConfig, ...]
    world: int
    device: str  # cpu or cuda, as the ranks will train
    settings: ProfileSettings

    @classmethod
    def of(
        cls, config: RunConfig, spec: ModelSpec, configs: tuple[ParallelConfig, ...], world: int, lengths: np.ndarray
    ) -> AutoProfile:
        from hydraulis.cost.sweep import check_configs

        device = config.train.device
        if device == "auto":
            from hydraulis.runtime.launch import device_kind  # torch, only to ask whether a GPU is there

            device = device_kind(device)
        settings = ProfileSettings(**_sweep_for(config.data.max_len, lengths), dtype=config.train.dtype)
        try:
            check_configs(spec, configs, world, device)
        except HydraulisError as exc:
            raise HydraulisError(f'parallel.profile = "auto": {exc}') from None
        return cls(spec, configs, world, device, settings)

    def mismatch(self, data: dict[str, Any]) -> str | None:
        """Why a cached profile does not describe this job (None: it does)."""
        device = data.get("device") or {}
        measurements = data.get("measurements") or {}
        have = {(r.get("tp"), r.get("pp"), r.get("cp", 1)) for r in data.get("time_ms") or [] if isinstance(r, dict)}
        missing = [c.name for c in self.configs if (c.tp, c.pp, c.cp) not in have]
        if data.get("model") != self.spec.to_dict():
            return "another model"
        if device.get("kind") != self.device or device.get("dtype") != self.settings.dtype_for(self.device):
            return "another device or dtype"
        if measurements.get("world_size") != self.world:
            return "another world size"
        if measurements.get("settings") != self.settings.to_json():
            return "another sweep"
        if missing:
            return f"it lacks {', '.join(missing)}"
        return None

    def cached(self, path: Path, log: Log = say) -> dict[str, Any] | None:
        """The profile at `path` if it describes this job; None (and why, in the log) otherwise."""
        if not path.is_file():
            return None
        try:
            data = read_json_object(path)
        except HydraulisError:
            data = None
        reason = "unreadable" if data is None else self.mismatch(data)
        if reason is None:
            log(f"cost model: {path} (profiled before for this model, pool, device and world size)")
            return data
        log(f"profiling again: {path} does not describe this job ({reason})")
        return None

    def measure(self, torchrun: bool, log: Log = say) -> dict[str, Any]:
        """Profile the configs now on `world` local processes, with a progress bar; returns the profile data."""
        if torchrun:
            raise HydraulisError(
                'parallel.profile = "auto" cannot profile under torchrun: run `hydraulis train --nproc` once, '
                "or `hydraulis profile` and set parallel.profile to its file"
            )
        from hydraulis.progress import steps_progress
        from hydraulis.runtime.profiler import check_job, profile_model, progress_steps

        check_job(self.spec, self.configs, self.world, self.device)
        names = ", ".join(c.name for c in self.configs)
        log(f"profiling {self.spec.name} ({names}) on {self.world} {self.device} rank(s) for the cost model")
        with steps_progress("profiling", progress_steps(self.configs, self.settings, self.world)) as step:
            data = profile_model(self.spec, self.configs, self.world, self.device, self.settings, progress=step)
        held = ", ".join(
            f"{name} {fid['holdout']['median_abs_rel_error']:.0%}" for name, fid in data["fidelity"].items()
        )
        log(f"profiled in {data['measurements']['wall_s']:.0f} s; held-out median error per config: {held}")
        return data
