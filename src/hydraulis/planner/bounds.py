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
) -> float:
    """LB over the cost model's configs that fit the job, or over `configs` (a deployment's, the proposal's
    ranking of phase deployments). `chunked`: a sequence beyond a config's cap may also run there in chunks
    (`cost.chunks`, the oracle): its chunks' work, recompute and fixed costs once, not pp times, and its
    trip one stage's. `interleave`: the cost model's configs also at their largest vp (`vp_choices`), whose
    bubble is the least, where plans may interleave."""
    configs = [g for g in (configs or cost.configs) if g.num_gpus <= num_gpus]
    if interleave:
        configs += [g.interleaved(g.vp_choices(cost.model)[0]) for g in configs if g.vp_choices(cost.model)]
    if not configs:
        smallest = min(g.num_gpus for g in cost.configs)
        raise HydraulisError(f"no parallel config of {cost.name} fits {num_gpus} GPU(s); the smallest needs {smallest}")
    return _Terms.of(lengths, cost, num_gpus, configs, chunked).bound(np.arange(len(configs)))


def lower_bounds(
    lengths: np.ndarray, cost: CostModel, num_gpus: int, config_sets: Sequence[Sequence[ParallelConfig]]
) -> list[float]:
    """`lower_bound` over each set of configs (deployments'), each config's terms computed once for all."""
    if not config_sets:
        return []
    every = list(dict.fromkeys(g for configs in config_sets for g in configs))
    terms = _Terms.of(lengths, cost, num_gpus, every, False)
    row = {g: k for k, g in enumerate(every)}
    return [terms.bound(np.array(sorted({row[g] for g in configs}), dtype=np.int64)) for configs in config_sets]


@dataclass(frozen=True)
class _Terms:
    """Per config (rows) and sequence (columns): its work terms, for a bound over any subset of the configs."""

    num_gpus: int
    lengths: np.ndarray
    holds: np.ndarray  # [configs] the longest sequence each holds
    spread_w: np.ndarray  # beside others, per stage
    alone_w: np.ndarray  # alone: pp trips
    trip: np.ndarray
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
        spread_w, alone_w = beside, pp * lone
        trip = pp * np.minimum(beside, lone)
        if chunked:  # chunks: their stage time, once, and their trip one stage's (`cost.chunks`)
            wc = chunked_stage_time(cost, configs, num_gpus, lengths)
            spread_w, trip = np.minimum(spread_w, wc), np.minimum(trip, wc)
        w_min = np.array([r.seq_costs(lengths[[int(np.argmin(lengths))]])[0] for r in reps])
        vp = np.array([g.vp for g in configs], dtype=np.float64)
        bubble = gpus[:, 0] * (pp[:, 0] - 1) / vp * w_min  # interleaved: vp chunks of 1/vp of it each
        return cls(num_gpus=num_gpus, lengths=lengths, holds=np.array([r.holds for r in reps]), spread_w=spread_w,
                   alone_w=alone_w, trip=trip, gpus=gpus, bubble=bubble)

    def bound(self, rows: np.ndarray) -> float:
        """LB over the configs of `rows`."""
        spread_w, alone_w, gpus = self.spread_w[rows], self.alone_w[rows], self.gpus[rows]
        fits = np.isfinite(spread_w) | np.isfinite(alone_w)
        if not fits.any(axis=0).all():
            longest = int(self.lengths[~fits.any(axis=0)].max())
            raise HydraulisError(f"no config holds a sequence of {longest} tokens (largest lone cap "
                                 f"{int(self.holds[rows].max())})")
        work = gpus * np.minimum(spread_w, alone_w)
        top = int(np.argmax(self.lengths))
        top_work = np.minimum(gpus[:, 0] * spread_w[:, top] + self.bubble[rows], gpus[:, 0] * alone_w[:, top])
        spread = (work.min(axis=0).sum() - work[:, top].min() + top_work.min()) / self.num_gpus
        return float(max(spread, self.trip[rows].min(axis=0).max()))
