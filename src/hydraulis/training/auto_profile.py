"""`[parallel] profile = "auto"`: measure the pool's configs on this job's own device before training.

The profile (`hydraulis profile`'s machinery) covers this job's device,
dtype, world size and document lengths. It is looked up first in the run
directory's `profile.json` (a resume, or a run that failed to start: the
run's own), then in the shared cache (`profile_cache.py`:
`$HYDRAULIS_CACHE/profiles`, keyed by model, configs, device, dtype, world
size, core count and sweep; the model by its content, the config as the
runtime reads it and, with init_from, the weights' headers, never by its
name or path, so a copied model is not profiled again), and measured
otherwise, stating its expected time first; a measured one goes into both.

What never enters the cache, so that one busy hour does not steer the runs
after it: a profile measured while other processes took a tenth of the
cores or more (it is kept in the run directory, for this run and its
resumes, and the next run profiles again), and a run's online refit
(kept beside the run as `profile.refit.json`; a later run starts from it
only when `[parallel] profile` names that file). `[parallel]
profile_cache = false` neither reads nor writes the cache. The run's
first lines say what it starts from (`start_lines`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from hydraulis.cost import profile_cache
from hydraulis.cost.measured import load_line, measured_under_load, others_load
from hydraulis.cost.sweep import ProfileSettings
from hydraulis.errors import HydraulisError
from hydraulis.families import weights_digest
from hydraulis.files import read_json_object
from hydraulis.parallel import ParallelConfig
from hydraulis.processes import interrupt
from hydraulis.progress import Log, say
from hydraulis.specs import ModelSpec

AUTO_PROFILE = "profile.json"  # the measured profile, cached in the run directory
# The online refit of the run's profile beside it (cost/refit.py, run_fidelity.py); never in the shared cache.
REFIT_PROFILE = "profile.refit.json"


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


def _content(model: dict[str, Any]) -> dict[str, Any]:
    """A model as the profile sees it: its config without its name (a directory's name, for init_from)."""
    return {k: v for k, v in model.items() if k != "name"}


@dataclass(frozen=True)
class AutoProfile:
    """`profile = "auto"`: these configs of this model, measured on this job's device, dtype and world size."""

    spec: ModelSpec
    configs: tuple[ParallelConfig, ...]
    world: int
    device: str  # cpu or cuda, as the ranks will train
    settings: ProfileSettings
    device_name: str = ""  # the GPU's name (or "cpu"): part of the shared cache's key
    weights: str = ""  # init_from: the digest of its weights' headers (families.weights_digest), else ""

    @classmethod
    def of(
        cls, spec: ModelSpec, configs: tuple[ParallelConfig, ...], world: int, lengths: np.ndarray, *, device: str,
        dtype: str, max_len: int, init_from: str | None,
    ) -> AutoProfile:
        """The request of a job: its `[train] device` (auto: a GPU if there is one) and dtype, the sweep of its
        `[data] max_len` and document `lengths`, and, with `[model] init_from`, its weights."""
        from hydraulis.cost.sweep import check_configs

        if device == "auto":
            from hydraulis.runtime.parallelism.launch import device_kind  # torch, only to ask whether a GPU is there

            device = device_kind(device)
        settings = ProfileSettings(**_sweep_for(max_len, lengths), dtype=dtype)
        try:
            check_configs(spec, configs, world, device)
        except HydraulisError as exc:
            raise HydraulisError(f'parallel.profile = "auto": {exc}') from None
        from hydraulis.runtime.metering.profiler import describe_device

        name = describe_device(device, world, settings.dtype_for(device), 1)["name"]
        weights = weights_digest(init_from) if init_from else ""
        return cls(spec=spec, configs=configs, world=world, device=device, settings=settings, device_name=name,
                   weights=weights)

    def machine(self) -> dict[str, Any]:
        return profile_cache.machine(self.device, self.device_name)

    def shared_path(self) -> Path:
        """This request's file in the shared cache."""
        identity = {
            "model": {**_content(self.spec.to_dict()), "weights": self.weights},
            "configs": sorted(c.name for c in self.configs),
            **self.machine(),
            "dtype": self.settings.dtype_for(self.device),
            "world": self.world,
            "sweep": self.settings.to_json(),
        }
        return profile_cache.cache_path(identity, self.spec.arch.family)

    def _analytic_s(self, steps: int) -> float | None:
        """The expected time by the analytic model of this device, when it knows the device (CPU)."""
        from hydraulis.cost.analytic import AnalyticCostModel
        from hydraulis.cost.sweep import sweep
        from hydraulis.specs import DEVICES

        if self.device_name not in DEVICES:
            return None
        cost = AnalyticCostModel(self.spec, DEVICES[self.device_name], configs=list(self.configs))
        rounds = 1 + self.settings.warmup + self.settings.repeats
        return sum(rounds * g.pp * cost.stage_time(g, point) for g in self.configs for point in sweep(self.settings))

    def mismatch(self, data: dict[str, Any]) -> str | None:
        """Why a cached profile does not describe this job (None: it does)."""
        device = data.get("device") or {}
        measurements = data.get("measurements") or {}
        have = {(r.get("tp"), r.get("pp"), r.get("cp", 1)) for r in data.get("time_ms") or [] if isinstance(r, dict)}
        missing = [c.name for c in self.configs if (c.tp, c.pp, c.cp) not in have]
        if not isinstance(data.get("model"), dict) or _content(data["model"]) != _content(self.spec.to_dict()):
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

    def cached(self, path: Path, log: Log = say, shared: bool = True) -> dict[str, Any] | None:
        """The profile at `path` if it describes this job; None (and why, in the log) otherwise.

        From the `shared` cache, a profile measured under load is refused too (one written before the cache
        kept only quiet ones): it would carry that hour's load into every later run. A run directory's own
        profile is this run's, whatever its load (a resume plans as the run it continues).
        """
        if not path.is_file():
            return None
        try:
            data = read_json_object(path)
        except HydraulisError:
            data = None
        reason = "unreadable" if data is None else self.mismatch(data)
        if reason is None and shared and measured_under_load(data):
            reason = f"measured while {others_load(data)}: the cache reuses only quiet profiles"
        if reason is not None:
            log(f"profiling again: {path} does not describe this job ({reason})")
            return None
        return data

    def measure(self, torchrun: bool, log: Log = say, keep: bool = True) -> dict[str, Any]:
        """Profile the configs now on `world` local processes, with a progress bar; returns the profile data,
        stamped with its time. It goes into the shared cache when `keep` and measured quiet."""
        if torchrun:
            raise HydraulisError(
                'parallel.profile = "auto" cannot profile under torchrun: run `hydraulis train --nproc` once, '
                "or `hydraulis profile` and set parallel.profile to its file"
            )
        from hydraulis.progress import steps_progress
        from hydraulis.runtime.metering.profiler import check_job, profile_model, progress_steps

        check_job(self.spec, self.configs, self.world, self.device)
        names = ", ".join(c.name for c in self.configs)
        steps = progress_steps(self.configs, self.settings, self.world)
        model = profile_cache.digest({**_content(self.spec.to_dict()), "weights": self.weights})
        analytic = self._analytic_s(steps)
        expected = profile_cache.expected_s(self.machine(), steps, model, analytic)
        guess = f"expected about {expected[0]:.0f} s ({expected[1]})" if expected is not None else "no estimate yet"
        log(
            f"profiling {self.spec.name} ({names}) on {self.world} {self.device} rank(s) for the cost model: "
            f"{steps} measurement steps, {guess}"
        )
        with steps_progress("profiling", steps) as step:
            data = profile_model(self.spec, self.configs, self.world, self.device, self.settings, progress=step)
        data["measurements"]["measured_at"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        if keep:  # the cache's timings too: parallel.profile_cache = false writes nothing there
            profile_cache.record_timing(self.machine(), steps, data["measurements"]["wall_s"], model, analytic)
        if not keep:
            kept = "for this run only: parallel.profile_cache = false"
        elif measured_under_load(data):
            kept = "for this run only: measured under load, the cache keeps only quiet profiles"
        else:
            kept = f"in {self.shared_path().parent}"
            with interrupt.held():  # stored and named together: an interruption's line says it is there
                profile_cache.store(self.shared_path(), data)
                interrupt.keep(f"the measured profile in {self.shared_path()} (the next run of this model uses it)")
        held = ", ".join(
            f"{name} {fid['holdout']['median_abs_rel_error']:.0%}" for name, fid in data["fidelity"].items()
        )
        log(f"profiled in {data['measurements']['wall_s']:.0f} s (kept {kept}); held-out median error per config: "
            f"{held}")
        load = load_line(data)
        if load:
            log(load)
        return data


def start_lines(data: dict[str, Any] | None, where: str, refit: str | None = None) -> list[str]:
    """A run's first word on what it starts from: the profile (where from, when it was measured, whether
    quiet) and the refit it carries: `refit` (a resume's, from its checkpoint), else the profile's own mark
    (a `profile.refit.json` that `[parallel] profile` names), else none."""
    if data is None:
        return [f"profile: {where} (analytic: nothing measured)", refit or "refit: none"]
    when = (data.get("measurements") or {}).get("measured_at")
    took = others_load(data)
    if took is None:
        load = "its load not measured"
    else:
        load = ("under load: " if measured_under_load(data) else "quiet: ") + took
    lines = [f"profile: {where}, measured {when or 'at a time it does not record'}, {load}"]
    mark = data.get("refit")
    if refit is None and isinstance(mark, dict):
        scales = ", ".join(f"{k} x{v:.2f}" for k, v in (mark.get("scales") or {}).items())
        refit = f"refit: run {mark.get('source')}'s after its step {mark.get('step')} ({scales}), named by " \
            "parallel.profile"
    lines.append(refit or "refit: none (this run refits from its own steps, starting from this profile)")
    return lines
