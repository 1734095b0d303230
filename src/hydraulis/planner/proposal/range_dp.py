"""Dynamic programme over (GPUs used x length ranges) that proposes deployments.

The published strategy generator splits the length axis into ranges and gives
each range d replicas of one config, minimising the slowest range group; one
deployment comes out per possible batch maximum length. This module holds that
programme once, with the group-time function as a parameter: the published
variant divides the range's work by d, the data-aware variant also charges
micro-batch overheads, pipeline bubbles and the fact that a long sequence
cannot be divided across replicas; under memory policies per micro-batch a
length beyond a config's cap costs what its lightest holding policy costs.

Everything is vectorised over the number of GPUs, so 1024 GPUs stay fast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.pool import place, usable_configs
from hydraulis.planner.replicas import ReplicaCost
from hydraulis.specs import ClusterSpec


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
    expected number of sequences get nothing to do. A length beyond the cap
    costs its lightest holding memory policy's (`ReplicaCost.seq_costs`); a
    range whose longest sequence exceeds every policy's cap beside others
    (`ReplicaCost.reach`) runs as one lone micro-batch per replica
    (`CostModel.lone_cap`): pp x (share + c), if a replica's share fits it.
    """
    reps = [ReplicaCost.of(cost, cfg, num_gpus) for cfg in configs]
    seq = np.stack([r.seq_costs(hist.lengths) for r in reps])  # under the policy each length needs
    work = np.concatenate([np.zeros((len(configs), 1)), np.cumsum(seq * hist.per_batch[None, :], axis=1)], axis=1)
    tokens = np.concatenate([[0.0], np.cumsum(hist.lengths * hist.per_batch)])
    count = np.concatenate([[0.0], np.cumsum(hist.per_batch)])
    c = np.array([r.c for r in reps])
    pp = np.array([cfg.pp for cfg in configs], dtype=np.float64)
    caps = np.array([max(r.cap, 1) for r in reps], dtype=np.float64)
    reach = np.array([r.reach for r in reps], dtype=np.float64)  # a micro-batch beside others, any policy
    lone = np.array([r.holds for r in reps], dtype=np.float64)
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
        trip = pp[k] * (seq[k, hi - 1] + c[k])
        if longest > reach[k]:
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
    unit = 1
    while num_gpus // unit > max_units:
        unit *= 2
    dp = _Programme(
        configs=tuple(configs),
        group_time=group_time,
        bounds=bounds,
        idx=np.concatenate([[0], np.searchsorted(hist.lengths, bounds, side="right")]),
        holds=np.array([cost.lone_cap(cfg, num_gpus) for cfg in configs]),
        unit=unit,
        units=num_gpus // unit,
    )
    R, M = len(bounds), dp.units
    best = np.full((R + 1, M + 1), np.inf)
    best[0, :] = 0.0
    # trace[j][m] = (k, i, units) or None meaning "as with m - 1 units"
    trace: list[list[_Step | None]] = [[None] * (M + 1) for _ in range(R + 1)]
    for j in range(1, R + 1):
        best[j], trace[j] = dp.up_to(j, best)
    return [
        (int(bounds[j - 1]), float(best[j, M]), dp.groups(trace, j)) for j in range(1, R + 1) if np.isfinite(best[j, M])
    ]


_Step = tuple[int, int, int]  # (config k, previous boundary i, units of GPUs) of the last range


@dataclass(frozen=True)
class _Programme:
    """The DP's fixed inputs: best[j, m] is the least time of ranges up to boundary j on m units of GPUs."""

    configs: tuple[ParallelConfig, ...]
    group_time: GroupTime
    bounds: np.ndarray  # the boundaries, sorted
    idx: np.ndarray  # histogram index of each boundary (lengths <= bound), with 0 in front
    holds: np.ndarray  # the longest sequence each config holds
    unit: int  # GPUs per unit
    units: int  # units in the cluster

    def up_to(self, j: int, best: np.ndarray) -> tuple[np.ndarray, list[_Step | None]]:
        """best[j] and its choices: the last range (i, j] on config k and u units, after best[i, m - u]."""
        M = self.units
        cand = np.full(M + 1, np.inf)
        choice: list[_Step | None] = [None] * (M + 1)
        for k, cfg in enumerate(self.configs):
            if self.holds[k] < self.bounds[j - 1]:
                continue
            d = np.arange(1, M + 1) * (self.unit / cfg.num_gpus)  # replicas per units (may be < 1)
            valid = np.isclose(d, np.round(d)) & (d >= 1)
            if not valid.any():
                continue
            for i in range(j):
                times = np.full(M + 1, np.inf)
                times[1:][valid] = self.group_time(k, np.array([self.idx[i], self.idx[j]]), np.round(d[valid]))
                values, u_best = _after(best[i], times)
                better = values < cand
                cand[better] = values[better]
                for m in np.flatnonzero(better):
                    choice[m] = (k, i, int(u_best[m]))
        # Using fewer GPUs is always allowed: carry the best of m - 1 forward.
        for m in range(1, M + 1):
            if cand[m - 1] < cand[m]:
                cand[m] = cand[m - 1]
                choice[m] = None
        return cand, choice

    def groups(self, trace: list[list[_Step | None]], j: int) -> list[RangeGroup]:
        """The range groups of best[j, all units], read back along the trace."""
        groups: list[RangeGroup] = []
        m = self.units
        while j > 0:
            step = trace[j][m]
            while step is None:
                m -= 1
                step = trace[j][m]
            k, i, u = step
            d = int(round(u * self.unit / self.configs[k].num_gpus))
            lo = int(self.bounds[i - 1]) if i > 0 else 0
            groups.append(RangeGroup(self.configs[k], d, lo, int(self.bounds[j - 1])))
            j, m = i, m - u
        return groups[::-1]


def _after(before: np.ndarray, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For every m: min over 1 <= u <= m of max(before[m - u], times[u]), and the best u."""
    m_idx = np.arange(len(before))
    A = np.maximum(before[np.clip(m_idx[:, None] - m_idx[None, :], 0, None)], times[None, :])
    A[m_idx[:, None] < m_idx[None, :]] = np.inf
    A[:, 0] = np.inf
    u_best = np.argmin(A, axis=1)
    return A[m_idx, u_best], u_best


def length_boundaries(hist: LengthHistogram, caps: Sequence[int], points: int = 16) -> list[int]:
    """Where ranges may split: every cap below the longest sequence, token-weighted quantiles, the maximum."""
    weights = hist.lengths * hist.per_batch
    cdf = np.cumsum(weights) / weights.sum()
    quantiles = hist.lengths[np.minimum(np.searchsorted(cdf, np.linspace(0, 1, points + 1)[1:-1]), len(cdf) - 1)]
    top = hist.max_length
    return sorted({int(c) for c in caps if 0 < c < top} | {int(q) for q in quantiles} | {top})


def groups_to_deployment(groups: Sequence[RangeGroup], cluster: ClusterSpec) -> Deployment | None:
    """Replicas of each range group, largest first; GPUs the programme left free join the shortest range."""
    configs: list[ParallelConfig] = []
    for g in sorted(groups, key=lambda g: -g.hi):
        configs += [g.config] * g.replicas
    free = cluster.num_gpus - sum(c.num_gpus for c in configs)
    if free < 0:
        return None
    if free:
        short = min(groups, key=lambda g: g.hi).config
        if free % short.num_gpus:
            return None
        configs += [short] * (free // short.num_gpus)
    return place(configs, cluster)


def dp_deployments(
    cost: CostModel, cluster: ClusterSpec, hist: LengthHistogram, aware: bool
) -> list[tuple[int, Deployment]]:
    """(batch max length, deployment) for each boundary, from the range programme."""
    N = cluster.num_gpus
    configs = usable_configs(cost, cluster)
    # CP configs enter the programme only for ranges no cp = 1 config holds (candidate_deployments
    # offers them where they pay on long sequences that cp = 1 configs hold too).
    plain_cap = max((cost.lone_cap(g, N) for g in configs if g.cp == 1), default=0)
    configs = [g for g in configs if g.cp == 1 or (plain_cap < hist.max_length and cost.lone_cap(g, N) > plain_cap)]
    group_time = aware_group_time(cost, configs, hist, N) if aware else published_group_time(cost, configs, hist)
    bounds = length_boundaries(hist, [cap for c in configs for cap in (cost.cap(c, N), cost.lone_cap(c, N))])
    out = []
    for max_length, _, groups in range_dp(cost=cost, num_gpus=N, hist=hist, configs=configs, group_time=group_time,
                                          boundaries=bounds):
        deployment = groups_to_deployment(groups, cluster)
        if deployment is not None:
            out.append((max_length, deployment))
    return out
