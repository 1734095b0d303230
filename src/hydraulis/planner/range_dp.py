"""Dynamic programme over (GPUs used x length ranges) that proposes deployments.

The published strategy generator splits the length axis into ranges and gives
each range d replicas of one config, minimising the slowest range group; one
deployment comes out per possible batch maximum length. This module holds that
programme once, with the group-time function as a parameter: the published
variant divides the range's work by d, the data-aware variant also charges
micro-batch overheads, pipeline bubbles and the fact that a long sequence
cannot be divided across replicas.

Everything is vectorised over the number of GPUs, so 1024 GPUs stay fast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.errors import HydraulisError
from hydraulis.parallel import ParallelConfig


@dataclass(frozen=True)
class LengthHistogram:
    """Sequence lengths with their expected count in one global batch."""

    lengths: np.ndarray  # sorted, unique, int64
    per_batch: np.ndarray  # expected count per global batch, float64

    @classmethod
    def from_batches(cls, batches: Sequence[np.ndarray]) -> LengthHistogram:
        if not batches:
            raise HydraulisError("a length distribution needs at least one batch")
        lengths, counts = np.unique(
            np.concatenate([np.asarray(b, dtype=np.int64) for b in batches]), return_counts=True
        )
        return cls(lengths, counts / len(batches))

    @property
    def tokens_per_batch(self) -> float:
        return float(np.dot(self.lengths, self.per_batch))

    @property
    def max_length(self) -> int:
        return int(self.lengths[-1])


@dataclass(frozen=True)
class RangeGroup:
    """d replicas of one config serving sequences with lengths in (lo, hi]."""

    config: ParallelConfig
    replicas: int
    lo: int
    hi: int


# group_time(config index k, lengths mask of the range, d replicas as an array) -> time per d
GroupTime = Callable[[int, np.ndarray, np.ndarray], np.ndarray]


def published_group_time(cost: CostModel, configs: Sequence[ParallelConfig], hist: LengthHistogram) -> GroupTime:
    """The published estimate: the range's total work on config k, divided by d."""
    work = np.concatenate(
        [
            np.zeros((len(configs), 1)),
            np.cumsum(cost.cost_matrix(hist.lengths, configs) * hist.per_batch[None, :], axis=1),
        ],
        axis=1,
    )

    def group_time(k: int, rng: np.ndarray, d: np.ndarray) -> np.ndarray:
        lo, hi = rng
        return (work[k, hi] - work[k, lo]) / d

    return group_time


def aware_group_time(
    cost: CostModel, configs: Sequence[ParallelConfig], hist: LengthHistogram, num_gpus: int
) -> GroupTime:
    """Range work over d replicas plus what the published estimate leaves out.

    Each replica packs its share into v micro-batches (at least tokens / cap),
    pays c per micro-batch and a 1F1B bubble of (pp - 1) micro-batches; and a
    sequence cannot be split, so a replica never finishes before the longest
    sequence of its range has crossed all pp stages. Replicas beyond the
    expected number of sequences get nothing to do. A range whose longest
    sequence exceeds the cap runs as one lone micro-batch per replica
    (`CostModel.lone_cap`): pp x (share + c), if a replica's share fits it.
    """
    weighted = cost.cost_matrix(hist.lengths, configs) * hist.per_batch[None, :]
    work = np.concatenate([np.zeros((len(configs), 1)), np.cumsum(weighted, axis=1)], axis=1)
    tokens = np.concatenate([[0.0], np.cumsum(hist.lengths * hist.per_batch)])
    count = np.concatenate([[0.0], np.cumsum(hist.per_batch)])
    a = np.array([cost.coefficients(c).a for c in configs])
    b = np.array([cost.coefficients(c).b for c in configs])
    c = np.array([cost.coefficients(c).c for c in configs])
    pp = np.array([cfg.pp for cfg in configs], dtype=np.float64)
    caps = np.array([max(cost.cap(cfg, num_gpus), 1) for cfg in configs], dtype=np.float64)
    lone = np.array([cost.lone_cap(cfg, num_gpus) for cfg in configs], dtype=np.float64)
    lengths = hist.lengths.astype(np.float64)

    def group_time(k: int, rng: np.ndarray, d: np.ndarray) -> np.ndarray:
        lo, hi = rng
        w = work[k, hi] - work[k, lo]
        if w <= 0:
            return np.zeros_like(d, dtype=np.float64)
        busy = np.minimum(d, max(count[hi] - count[lo], 1.0))  # replicas that get sequences
        share = w / busy
        v = np.maximum(1.0, np.ceil((tokens[hi] - tokens[lo]) / busy / caps[k]))
        longest = lengths[hi - 1]
        trip = pp[k] * (a[k] * longest * longest + b[k] * longest + c[k])
        if longest > caps[k]:
            fits = (tokens[hi] - tokens[lo]) / busy <= lone[k]
            return np.where(fits, np.maximum(pp[k] * (share + c[k]), trip), np.inf)
        return np.maximum(share + v * c[k] + (pp[k] - 1) * (share / v + c[k]), trip)

    return group_time


def range_dp(
    cost: CostModel,
    num_gpus: int,
    hist: LengthHistogram,
    configs: Sequence[ParallelConfig],
    group_time: GroupTime,
    boundaries: Sequence[int],
    max_units: int = 128,
) -> list[tuple[int, float, list[RangeGroup]]]:
    """For each boundary (a batch maximum length), the best range groups and their time.

    Returns [(max_length, time, groups)] for every boundary the configs can hold.
    GPUs are counted in units (a power of two) so that at most `max_units` values
    are enumerated; a config smaller than a unit comes in whole units of replicas.
    """
    bounds = np.asarray(sorted(set(int(x) for x in boundaries)), dtype=np.int64)
    if len(bounds) == 0:
        raise HydraulisError("range DP needs at least one length boundary")
    sizes = [cfg.num_gpus for cfg in configs]
    unit = 1
    while num_gpus // unit > max_units:
        unit *= 2
    M = num_gpus // unit
    caps = np.array([cost.lone_cap(cfg, num_gpus) for cfg in configs])  # the longest sequence each holds
    # Histogram index of each boundary: lengths <= bound.
    idx = np.concatenate([[0], np.searchsorted(hist.lengths, bounds, side="right")])
    R = len(bounds)
    inf = np.inf
    best = np.full((R + 1, M + 1), inf)
    best[0, :] = 0.0
    # trace[j][m] = (k, i, units) or None meaning "as with m - 1 units"
    trace: list[list[tuple[int, int, int] | None]] = [[None] * (M + 1) for _ in range(R + 1)]
    m_idx = np.arange(M + 1)
    for j in range(1, R + 1):
        cand = np.full(M + 1, inf)
        choice: list[tuple[int, int, int] | None] = [None] * (M + 1)
        for k in range(len(configs)):
            if caps[k] < bounds[j - 1]:
                continue
            per_unit = unit / sizes[k]  # replicas per unit of GPUs (may be < 1)
            units = np.arange(1, M + 1)
            d = units * per_unit
            valid = np.isclose(d, np.round(d)) & (d >= 1)
            if not valid.any():
                continue
            for i in range(j):
                times = np.full(M + 1, inf)
                times[1:][valid] = group_time(k, np.array([idx[i], idx[j]]), np.round(d[valid]))
                # A[m, u] = max(best[i, m - u], times[u]) for 1 <= u <= m
                prev = best[i][np.clip(m_idx[:, None] - m_idx[None, :], 0, None)]
                A = np.maximum(prev, times[None, :])
                A[m_idx[:, None] < m_idx[None, :]] = inf
                A[:, 0] = inf
                u_best = np.argmin(A, axis=1)
                values = A[m_idx, u_best]
                better = values < cand
                if better.any():
                    cand[better] = values[better]
                    for m in np.flatnonzero(better):
                        choice[m] = (k, i, int(u_best[m]))
        # Using fewer GPUs is always allowed: carry the best of m - 1 forward.
        for m in range(1, M + 1):
            if cand[m - 1] < cand[m]:
                cand[m] = cand[m - 1]
                choice[m] = None
        best[j] = cand
        trace[j] = choice

    results = []
    for j in range(1, R + 1):
        if not np.isfinite(best[j, M]):
            continue
        groups: list[RangeGroup] = []
        jj, m = j, M
        while jj > 0:
            step = trace[jj][m]
            while step is None:
                m -= 1
                step = trace[jj][m]
            k, i, u = step
            d = int(round(u * unit / sizes[k]))
            lo = int(bounds[i - 1]) if i > 0 else 0
            groups.append(RangeGroup(configs[k], d, lo, int(bounds[jj - 1])))
            jj, m = i, m - u
        results.append((int(bounds[j - 1]), float(best[j, M]), groups[::-1]))
    return results
