"""Workloads: the sequence lengths of global batches, `hydraulis.workload/1`.

A workload is either explicit `batches` (lists of lengths in tokens) or a
histogram (`lengths` + `counts`) from which batches are sampled to a token
budget with a seed. The planner, the proposal and the benchmarks read these;
they never need the tokens themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hydraulis.errors import HydraulisError
from hydraulis.files import Fields, load_json, write_json_atomic
from hydraulis.limits import (
    MAX_BATCHES,
    MAX_LENGTH,
    MAX_SEED,
    MAX_SEQUENCES,
    MAX_TOKENS_PER_BATCH,
    check_batch_size,
    check_int,
    finite,
    short_repr,
)

WORKLOAD_SCHEMA = "hydraulis.workload/1"


@dataclass(frozen=True)
class Workload:
    name: str
    batches: tuple[np.ndarray, ...]  # each an int64 array of lengths

    @property
    def max_length(self) -> int:
        return int(max(int(b.max()) for b in self.batches))

    def to_dict(self) -> dict:
        return {"schema": WORKLOAD_SCHEMA, "name": self.name, "batches": [b.tolist() for b in self.batches]}


def sample_batches(
    lengths: Sequence[int] | np.ndarray,
    counts: Sequence[float] | np.ndarray | None,
    tokens_per_batch: int,
    num_batches: int,
    seed: int = 0,
) -> list[np.ndarray]:
    """Draw sequences i.i.d. from the histogram until each batch reaches the token budget.

    A batch stops before the sequence that would overflow the budget; a batch
    always holds at least one sequence.
    """
    check_int(tokens_per_batch, "tokens per batch", 1, MAX_TOKENS_PER_BATCH)
    check_int(num_batches, "number of batches", 1, MAX_BATCHES)
    check_int(seed, "seed", 0, MAX_SEED)
    if len(lengths) == 0:
        raise HydraulisError("cannot sample batches from an empty length distribution")
    lengths = np.asarray(lengths, dtype=np.int64)
    p = None
    if counts is not None:
        weights = np.asarray(counts, dtype=np.float64)
        if weights.shape != lengths.shape or not np.isfinite(weights).all() or np.any(weights < 0):
            raise HydraulisError("counts must be finite, non-negative and one per length")
        total = weights.sum()
        if not np.isfinite(total) or total <= 0:
            raise HydraulisError("counts must not all be zero, and their sum must be finite")
        p = weights / total
    rng = np.random.default_rng(seed)
    mean = float(np.dot(p, lengths)) if p is not None else float(lengths.mean())
    expected = tokens_per_batch / max(mean, 1.0)
    check_batch_size(expected, "histogram workload")
    if expected * num_batches > MAX_SEQUENCES * 16:
        raise HydraulisError(
            f"{num_batches} batches of about {expected:,.0f} sequences is too large a workload; write fewer batches"
        )
    chunk = max(16, int(2 * tokens_per_batch / max(mean, 1.0)))
    batches = []
    for _ in range(num_batches):
        batch: list[np.ndarray] = []
        total = 0
        while True:
            draw = lengths[rng.choice(len(lengths), size=chunk, p=p)]
            csum = total + np.cumsum(draw)
            fit = int(np.searchsorted(csum, tokens_per_batch, side="right"))
            if fit == 0 and total == 0:
                fit = 1  # a single sequence above the budget still forms a batch
            batch.append(draw[:fit])
            if fit < chunk:
                break
            total = int(csum[-1])
        batches.append(np.concatenate(batch))
    return batches


def load_workload(
    path: str | Path, tokens_per_batch: int | None = None, num_batches: int | None = None, seed: int | None = None
) -> Workload:
    """Read a workload; a histogram workload is sampled (arguments override the file's settings)."""
    data = load_json(path, WORKLOAD_SCHEMA)
    f = Fields(data, str(path))
    name = f.str("name", default=Path(path).stem)
    if "batches" in data:
        batches = []
        for i, batch in enumerate(f.list("batches")):
            if not isinstance(batch, list) or not batch:
                raise HydraulisError(f"{path}: batches[{i}] is empty; a global batch needs at least one sequence")
            if len(batch) > MAX_SEQUENCES:
                raise HydraulisError(
                    f"{path}: batches[{i}] holds {len(batch):,} sequences, more than the {MAX_SEQUENCES:,} allowed"
                )
            arr = _lengths(batch, f"{path}: batches[{i}]")
            batches.append(arr)
            if i + 1 > MAX_BATCHES:
                raise HydraulisError(f"{path}: more than {MAX_BATCHES} batches")
        if not batches:
            raise HydraulisError(f"{path}: no batches")
        return Workload(name, tuple(batches))
    if "lengths" not in data:
        raise HydraulisError(f"{path}: needs either 'batches' or 'lengths' + 'counts'")
    lengths = _lengths(f.list("lengths"), f"{path}: lengths")
    counts = f.list("counts")
    if len(counts) != len(lengths):
        raise HydraulisError(f"{path}: {len(lengths)} lengths but {len(counts)} counts")
    for i, c in enumerate(counts):
        if isinstance(c, bool) or not isinstance(c, int | float) or not finite(c) or c < 0:
            raise HydraulisError(f"{path}: counts[{i}] must be a finite non-negative number, got {short_repr(c)}")
    batches = sample_batches(
        lengths,
        counts,
        tokens_per_batch
        if tokens_per_batch is not None
        else f.int("tokens_per_batch", default=262144, minimum=1, maximum=MAX_TOKENS_PER_BATCH),
        num_batches if num_batches is not None else f.int("num_batches", default=8, minimum=1, maximum=MAX_BATCHES),
        seed if seed is not None else f.int("seed", default=0, minimum=0, maximum=MAX_SEED),
    )
    return Workload(name, tuple(batches))


def save_workload(path: str | Path, workload: Workload) -> None:
    write_json_atomic(path, workload.to_dict())


def _lengths(values: list, where: str) -> np.ndarray:
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise HydraulisError(f"{where}[{i}]: sequence length must be an integer, got {short_repr(v)}")
        if not 1 <= v <= MAX_LENGTH:
            raise HydraulisError(
                f"{where}[{i}]: sequence length must be between 1 and {MAX_LENGTH} (2^31 - 1), got {short_repr(v)}"
            )
    return np.asarray(values, dtype=np.int64)
