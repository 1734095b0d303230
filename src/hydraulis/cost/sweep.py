"""What `hydraulis profile` measures: its settings, the sweep of micro-batches, the job's checks.

Torch-free, so that bad input fails before any process (or torch) starts,
and so that a caller (the train command's `profile = "auto"`) can check a
profiling job up front; runtime/metering/profiler.py runs it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hydraulis.errors import HydraulisError
from hydraulis.parallel import ParallelConfig
from hydraulis.specs import DTYPE_NAMES, ModelSpec


@dataclass(frozen=True)
class ProfileSettings:
    """What to sweep and how often to repeat it (defaults: about a minute for `tiny` on a few CPU cores)."""

    totals: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    min_doc: int = 128  # shortest document: below it per-document overheads the model has no term for dominate
    max_doc: int = 1024
    warmup: int = 1
    repeats: int = 5
    dtype: str | None = None  # fp32 on CPU, bf16 on CUDA
    holdout_fraction: float = 1 / 3
    seed: int = 0
    collective_bytes: tuple[int, ...] = (2**10, 2**13, 2**16, 2**19, 2**22)  # per rank, all it sends
    collective_repeats: int = 5
    # Rounds of every config in turn, not each config's sweep at once: load from other processes
    # drifts over minutes, and interleaving spreads it over all configs instead of biasing some.
    # All configs' models are then held at once; False frees each before the next (large models).
    interleave: bool = True
    threads: int | None = None  # torch threads per rank; None: as `hydraulis train --nproc` (cores / ranks)
    # A timed round during which other processes took a tenth of the cores or more runs again, this often
    # (and at most half of all timed rounds run again: runtime/metering/profiler.py's LoadCheck).
    load_retries: int = 1

    def __post_init__(self) -> None:
        if not self.totals or any(t < 1 for t in self.totals):
            raise HydraulisError(f"sweep totals must be positive token counts, got {list(self.totals)}")
        if not 1 <= self.min_doc <= self.max_doc:
            raise HydraulisError(f"documents need 1 <= min_doc <= max_doc, got {self.min_doc} and {self.max_doc}")
        if self.threads is not None and self.threads < 1:
            raise HydraulisError(f"threads per rank must be positive, got {self.threads}")
        if self.warmup < 0 or self.repeats < 1 or self.collective_repeats < 1:
            raise HydraulisError("warm-up must be non-negative and repeats at least 1")
        if self.load_retries < 0:
            raise HydraulisError(f"--load-retries must be non-negative, got {self.load_retries}")
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise HydraulisError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPE_NAMES)}")
        if not 0 < self.holdout_fraction < 1:
            raise HydraulisError(f"the held-out fraction must lie in (0, 1), got {self.holdout_fraction}")
        if not self.collective_bytes or any(b < 4 for b in self.collective_bytes):
            raise HydraulisError("collective sizes must be at least 4 bytes")
        if len(sweep(self)) < 4:
            raise HydraulisError(
                f"the sweep has {len(sweep(self))} micro-batches; fitting and a held-out check need at least 4 "
                "(more totals, or a wider document range)"
            )

    def dtype_for(self, device: str) -> str:
        return self.dtype or ("bf16" if device == "cuda" else "fp32")

    def to_json(self) -> dict[str, Any]:
        """As a profile's `measurements.settings` stores them (tuples as lists), for writing and comparing."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}


def sweep(settings: ProfileSettings) -> list[tuple[int, ...]]:
    """The micro-batches (document lengths) to time: sum(s) and sum(s^2) vary independently."""
    points: list[tuple[int, ...]] = []
    for total in sorted(set(settings.totals)):
        k = 1
        while total // k >= settings.min_doc:
            if total // k <= settings.max_doc:
                points.append((total // k,) * k)
            k *= 2
        half, eighth = total // 2, total // 8
        if eighth >= settings.min_doc and half <= settings.max_doc:
            points.append((half, eighth, eighth, eighth, eighth))
    return list(dict.fromkeys(points))


def parse_config_list(text: str) -> list[ParallelConfig]:
    """`tp1pp1,tp2pp1` or `(tp1,pp1),(tp2,pp1)`: commas inside parentheses belong to a config."""
    parts = [p.strip() for p in re.split(r",(?![^()]*\))", text) if p.strip()]
    if not parts:
        raise HydraulisError("no parallel configs given; write them like 'tp1pp1,tp2pp1'")
    return [ParallelConfig.parse(p) for p in parts]


def check_configs(spec: ModelSpec, configs: Sequence[ParallelConfig], nproc: int | None, device: str) -> int:
    """The checks that need no torch (configs against the model and the world size); returns the world size."""
    if not configs:
        raise HydraulisError("no parallel configs to profile")
    if device not in ("cpu", "cuda"):
        raise HydraulisError(f"unknown device {device!r}; use cpu or cuda")
    seen: set[ParallelConfig] = set()
    for config in configs:
        if config in seen:
            raise HydraulisError(f"{config.name} is given twice")
        seen.add(config)
        config.validate(spec)
    world = max(c.num_gpus for c in configs) if nproc is None else nproc
    if world < 1:
        raise HydraulisError(f"--nproc must be positive, got {world}")
    for config in configs:
        if config.num_gpus > world:
            raise HydraulisError(f"{config.name} needs {config.num_gpus} processes, more than the {world} of the job")
        if world % config.num_gpus:
            raise HydraulisError(
                f"{config.name} uses {config.num_gpus} processes, which does not divide the job's {world}: "
                "the profiler runs as many replicas of each config as fill the job"
            )
    return world
