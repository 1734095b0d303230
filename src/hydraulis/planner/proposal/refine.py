"""The proposal's local search: from the candidate planned fastest, its neighbours one step away."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.pool import homogeneous_estimate, place, unique_deployments, usable_configs
from hydraulis.planner.proposal.screen import plan_times
from hydraulis.specs import ClusterSpec

REFINE_FILLS = 6  # cp = 1 configs a refined deployment's GPUs may go to, best alone first
MIN_REFINE = 0.002  # a neighbour must beat the current deployment by this share on the samples


def neighbours(
    cost: CostModel, cluster: ClusterSpec, d: Deployment, fills: Sequence[ParallelConfig], longest: int
) -> list[Deployment]:
    """Deployments one step from `d` that still hold `longest`: a replica of a group given to another group,
    a group's GPUs given to another config of `fills`, or one replica's GPUs to replicas of a `fills` config.
    The candidates' fixed shapes (k large replicas beside small ones of the best few configs) miss the best mix
    where the best small config ranks low alone (7b-32g-code: 3x tp2pp1cp4 + 4x tp2pp1, 3% below 4x tp2pp1cp4)."""
    N = cluster.num_gpus
    groups = Counter(d.configs)
    out: list[list[ParallelConfig]] = []

    def spread(base: Counter, gpus: int, g: ParallelConfig) -> None:
        if gpus > 0 and gpus % g.num_gpus == 0:
            out.append([h for h, n in (base + Counter({g: gpus // g.num_gpus})).items() for _ in range(n)])

    for g, n in groups.items():
        rest = groups - Counter({g: n})
        for h in fills:  # the group's GPUs to another config, or one replica's GPUs beside n - 1 of them
            if h != g:
                spread(rest, n * g.num_gpus, h)
                spread(rest + Counter({g: n - 1}), g.num_gpus, h)
        for h, m in rest.items():  # one more replica of g, taken from h's GPUs
            if g.num_gpus % h.num_gpus == 0 and m > g.num_gpus // h.num_gpus:
                moved = groups + Counter({g: 1}) - Counter({h: g.num_gpus // h.num_gpus})
                out.append([x for x, k in moved.items() for _ in range(k)])
    found = []
    for configs in out:
        if (sum(g.num_gpus for g in configs) == N and max(cost.lone_cap(g, N) for g in configs) >= longest
                and (placed := place(sorted(configs, key=lambda g: -cost.lone_cap(g, N)), cluster)) is not None):
            found.append(placed)
    return unique_deployments(found)


def refine(
    cost: CostModel,
    cluster: ClusterSpec,
    candidates: list[Deployment],
    times: np.ndarray,
    batches: Sequence[np.ndarray],
    longest: int,
    budget: int,
    memo: dict | None = None,
) -> tuple[list[Deployment], np.ndarray]:
    """A local search from the candidate planned fastest on the samples: its neighbours (`neighbours`) planned,
    the best taken while it beats the current by MIN_REFINE, at most `budget` of them (a count, not seconds: the
    pool must not move with the machine's load). Every deployment planned joins the candidates (the pool's
    greedy may want one for some batches; their plans go to `memo`, as `plan_times`')."""
    N = cluster.num_gpus
    fills = [g for g in usable_configs(cost, cluster) if g.cp == 1]
    fills = sorted(fills, key=lambda g: homogeneous_estimate(cost, g, N, [b[b <= cost.cap(g, N)] for b in batches]))
    fills = fills[:REFINE_FILLS] + [g for g in dict.fromkeys(c for d in candidates for c in d.configs) if g.cp > 1]
    seen = {str(d) for d in candidates}
    current, left = int(np.argmin(np.where(np.isfinite(times), times, 1e30).sum(axis=1))), budget
    while left > 0:
        fresh = [d for d in neighbours(cost, cluster, candidates[current], fills, longest) if str(d) not in seen]
        fresh, left = fresh[:left], left - len(fresh[:left])
        if not fresh:
            break
        seen.update(str(d) for d in fresh)
        planned = plan_times(cost, cluster, fresh, batches, None, memo=memo)
        candidates, times = [*candidates, *fresh], np.vstack([times, planned])
        totals = np.where(np.isfinite(times), times, 1e30).sum(axis=1)
        best = int(np.argmin(totals))
        if totals[best] >= totals[current] * (1 - MIN_REFINE):
            break
        current = best
    return candidates, times
