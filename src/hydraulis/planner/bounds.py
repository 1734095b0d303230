"""The lower bound on an iteration's time: what no plan avoids (docs/design.md section 5).

With w_g(s) = a_g s^2 + b_g s (one stage, c left out), n_g = tp*pp*cp GPUs and
N the job's GPUs, over the configs g that hold s (the lone cap):

- work: every sequence takes n_g * w_g(s) GPU-seconds on its config, pp_g
  times that when s is beyond g's cap (it runs as its replica's only
  micro-batch, so each stage idles (pp - 1) * w_g(s) of its trip), the less of
  the two where both hold it; under memory policies per micro-batch w_g(s) is
  the lightest policy's that holds it, beside others or alone
  (`ReplicaCost.lightest`: alone may run a lighter one);
- bubble: the replica that holds the longest sequence idles at least
  (pp_g - 1) * w_g(s_min) per stage under 1F1B (its first forward and last
  backward cross every other stage), which the work term does not count;
  interleaved with vp_g chunks per stage, (pp_g - 1) / vp_g * w_g(s_min): the
  first forward and last backward cross the others chunk by chunk;
- trip: the longest sequence crosses its pipeline, pp_g * w_g(s).

    LB = max( (sum_i min_g work_g(s_i) + bubble) / N ,  max_i min_g pp_g * w_g(s_i) )

Each replica's time in the simulator is at least its stages' work plus that
bubble, and replicas of one phase hold disjoint GPUs, so no plan beats LB.

With the trips in it (`lower_bound`'s own): a sequence runs within one phase on
one replica, so in a plan of time T its way of running (config; beside others,
alone or in chunks) has its trip <= T (beside others pp_g * w_g(s), the lightest
policy's of both; alone pp_g times the lone w_g(s); chunked one stage's). With
work_T and bubble_T the terms over those ways only, every plan of time T has
T >= F(T) = (sum_i min work_T(s_i) + bubble_T) / N; F does not rise with T, so

    LB* = the least T >= max_i min trip(s_i) with T >= F(T)  (>= LB)

is the least max(t, F(t)) over the trips t, each sequence's F steps summed by a
sort (`_Terms.scan`). The proposal ranks deployments on LB (`lower_bounds`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.chunks import chunked_stage_time
from hydraulis.cost.model import CostModel
from hydraulis.errors import HydraulisError
from hydraulis.parallel import ParallelConfig
from hydraulis.planner.replicas import ReplicaCost


def lower_bound(
    lengths: np.ndarray,
    cost: CostModel,
    num_gpus: int,
    configs: Sequence[ParallelConfig] | None = None,
    chunked: bool = False,
    interleave: bool = False,
    trips: bool = True,
) -> float:
    """LB* over the cost model's configs that fit the job, or over `configs` (a deployment's). `chunked`: a
    sequence beyond a config's cap may also run there in chunks (`cost.chunks`, the oracle): its chunks' work,
    recompute and fixed costs once, not pp times, and its trip one stage's. `interleave`: the cost model's
    configs also at every vp a plan may run (the recipes' `vp_choices`, the baselines', and hydraulis's
    `planned_vp_choices`), each its own bubble and cap, where plans may interleave.
    `trips` off: LB, each sequence on its cheapest config whatever its trip."""
    configs = [g for g in (configs or cost.configs) if g.num_gpus <= num_gpus]
    if interleave:
        bases = dict.fromkeys(g.base for g in configs)
        vps = [(g, sorted({*g.vp_choices(cost.model), *g.planned_vp_choices(cost.model)})) for g in bases]
        configs = list(dict.fromkeys([*configs, *(g.interleaved(v) for g, choices in vps for v in choices)]))
    if not configs:
        smallest = min(g.num_gpus for g in cost.configs)
        raise HydraulisError(f"no parallel config of {cost.name} fits {num_gpus} GPU(s); the smallest needs {smallest}")
    return _Terms.of(lengths, cost, num_gpus, configs, chunked).bound(np.arange(len(configs)), trips)


def lower_bounds(
    lengths: np.ndarray, cost: CostModel, num_gpus: int, config_sets: Sequence[Sequence[ParallelConfig]],
    trips: bool = False,
) -> list[float]:
    """`lower_bound` over each set of configs (deployments'), each config's terms computed once for all. The
    proposal ranks its phase deployments on LB (`trips` off): LB* ranked them to the same plans on the three
    long scenarios measured, not shown better (docs/results.md)."""
    if not config_sets:
        return []
    every = list(dict.fromkeys(g for configs in config_sets for g in configs))
    terms = _Terms.of(lengths, cost, num_gpus, every, False)
    row = {g: k for k, g in enumerate(every)}
    return [terms.bound(np.array(sorted({row[g] for g in configs}), dtype=np.int64), trips) for configs in config_sets]


@dataclass(frozen=True)
class _Terms:
    """Per config (rows) and sequence (columns): its work terms, for a bound over any subset of the configs."""

    num_gpus: int
    lengths: np.ndarray
    holds: np.ndarray  # [configs] the longest sequence each holds
    beside_w: np.ndarray  # beside others, per stage
    alone_w: np.ndarray  # alone: pp trips, its trip too
    trip: np.ndarray  # beside others: pp_g w_g(s), the lighter of both policies
    chunk_w: np.ndarray  # in chunks: one stage's time, its trip too (inf: not chunked)
    gpus: np.ndarray  # [configs, 1]
    bubble: np.ndarray  # [configs]

    @classmethod
    def of(cls, lengths: np.ndarray, cost: CostModel, num_gpus: int, configs: Sequence[ParallelConfig],
           chunked: bool) -> _Terms:
        lengths = np.asarray(lengths, dtype=np.int64)
        reps = [ReplicaCost.of(cost, g, num_gpus) for g in configs]
        beside, lone = (np.stack(x) for x in zip(*(r.lightest(lengths) for r in reps), strict=True))
        gpus = np.array([g.num_gpus for g in configs], dtype=np.float64)[:, None]
        pp = np.array([g.pp for g in configs], dtype=np.float64)[:, None]
        # Per GPU of a config: beside others once (plus the bubble, for the longest), or alone pp trips.
        trip = pp * np.minimum(beside, lone)
        chunk_w = np.full_like(beside, np.inf)
        if chunked:  # chunks: their stage time, once, and their trip one stage's (`cost.chunks`)
            chunk_w = chunked_stage_time(cost, configs, num_gpus, lengths)
        w_min = np.array([r.seq_costs(lengths[[int(np.argmin(lengths))]])[0] for r in reps])
        vp = np.array([g.vp for g in configs], dtype=np.float64)
        bubble = gpus[:, 0] * (pp[:, 0] - 1) / vp * w_min  # interleaved: vp chunks of 1/vp of it each
        return cls(num_gpus=num_gpus, lengths=lengths, holds=np.array([r.holds for r in reps]), beside_w=beside,
                   alone_w=pp * lone, trip=trip, chunk_w=chunk_w, gpus=gpus, bubble=bubble)

    def bound(self, rows: np.ndarray, trips: bool = True) -> float:
        """LB over the configs of `rows`; `trips`: LB*, the scan over the trips (module docstring)."""
        spread_w = np.minimum(self.beside_w[rows], self.chunk_w[rows])  # beside others or in chunks: the less
        alone_w, gpus = self.alone_w[rows], self.gpus[rows]
        fits = np.isfinite(spread_w) | np.isfinite(alone_w)
        if not fits.any(axis=0).all():
            longest = int(self.lengths[~fits.any(axis=0)].max())
            raise HydraulisError(f"no config holds a sequence of {longest} tokens (largest lone cap "
                                 f"{int(self.holds[rows].max())})")
        least_trip = float(np.minimum(self.trip[rows], self.chunk_w[rows]).min(axis=0).max())
        if trips:
            return self.scan(rows, least_trip)
        work = gpus * np.minimum(spread_w, alone_w)
        top = int(np.argmax(self.lengths))
        top_work = np.minimum(gpus[:, 0] * spread_w[:, top] + self.bubble[rows], gpus[:, 0] * alone_w[:, top])
        spread = (work.min(axis=0).sum() - work[:, top].min() + top_work.min()) / self.num_gpus
        return float(max(spread, least_trip))

    def scan(self, rows: np.ndarray, least_trip: float) -> float:
        """The least max(t, F(t)) over the trips t >= `least_trip`: each way of running each sequence (config;
        beside others, alone, in chunks) as work and trip, each sequence's least work among those of trip <= t
        stepping down at its own trips; the steps of all sequences, sorted by trip, summed."""
        gpus, top = self.gpus[rows], int(np.argmax(self.lengths))
        beside, chunks = gpus * self.beside_w[rows], gpus * self.chunk_w[rows]
        beside[:, top] += self.bubble[rows]  # the replica that holds the longest idles its bubble beside others
        chunks[:, top] += self.bubble[rows]
        work = np.concatenate([beside, gpus * self.alone_w[rows], chunks])
        trip = np.concatenate([self.trip[rows], self.alone_w[rows], self.chunk_w[rows]])
        trip = np.where(np.isfinite(work), np.maximum(trip, least_trip), np.inf)
        order = np.argsort(trip, axis=0, kind="stable")
        least = np.minimum.accumulate(np.take_along_axis(work, order, axis=0), axis=0)
        at, step = np.take_along_axis(trip, order, axis=0)[1:].ravel(), np.diff(least, axis=0).ravel()
        steps = np.flatnonzero(step < 0)
        by = np.argsort(at[steps], kind="stable")
        t = np.concatenate([[least_trip], at[steps][by]])
        total = least[0].sum() + np.concatenate([[0.0], np.cumsum(step[steps][by])])
        return float(np.min(np.maximum(t, total / self.num_gpus)))
