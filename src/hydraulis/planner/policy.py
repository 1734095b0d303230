"""What every policy (the planner and the baselines) returns: a Schedule of one or more phases.

Most policies run a global batch on one deployment: one phase. Temporal
switching (hotspa) runs several phases one after another, each a homogeneous
deployment over the whole cluster on part of the batch, and pays a switch
between phases. Gradients accumulate over the phases and are synchronised once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment
from hydraulis.planner.plan import IterationPlan
from hydraulis.sim import simulate
from hydraulis.specs import ClusterSpec


@dataclass(frozen=True)
class Schedule:
    """One iteration: phases in execution order; `indices[k]` maps phase k's sequences to the batch."""

    step: int
    lengths: tuple[int, ...]
    phases: tuple[IterationPlan, ...]
    indices: tuple[tuple[int, ...], ...]
    switch_s: float  # paid once between consecutive phases
    iteration_time_s: float
    planning_time_s: float

    @property
    def num_tokens(self) -> int:
        return int(sum(self.lengths))

    @classmethod
    def single(cls, plan: IterationPlan) -> Schedule:
        return cls(
            plan.step,
            plan.lengths,
            (plan,),
            (tuple(range(len(plan.lengths))),),
            0.0,
            plan.predicted_time_s,
            plan.planning_time_s,
        )


def phases_time(phases: list[IterationPlan] | tuple[IterationPlan, ...], cost: CostModel, switch_s: float) -> float:
    """Simulated compute of each phase, one switch between phases, one gradient sync."""
    if len(phases) == 1:
        return simulate(phases[0], cost, keep_events=False).iteration_time_s
    compute = sum(simulate(p, cost, keep_events=False).compute_time_s for p in phases)
    return compute + switch_s * (len(phases) - 1) + cost.grad_sync_time(phases[0].deployment.num_gpus)


def check_schedule(schedule: Schedule, cost: CostModel | None = None) -> None:
    """Each sequence of the batch in exactly one phase, with its own length; each phase a valid plan
    (within its caps too if `cost` is given). A HydraulisError names what is wrong."""
    where = f"step {schedule.step}"
    n = len(schedule.lengths)
    if not schedule.phases:
        raise HydraulisError(f"{where}: the schedule has no phases")
    if len(schedule.phases) != len(schedule.indices):
        raise HydraulisError(f"{where}: {len(schedule.phases)} phases but {len(schedule.indices)} index maps")
    seen = np.zeros(n, dtype=np.int64)
    for k, (plan, idx) in enumerate(zip(schedule.phases, schedule.indices, strict=True)):
        plan.validate(cost, where=f"{where} phase {k}")
        if any(not 0 <= i < n for i in idx):
            raise HydraulisError(f"{where} phase {k}: a batch position outside 0..{n - 1}")
        if tuple(schedule.lengths[i] for i in idx) != plan.lengths:
            raise HydraulisError(f"{where} phase {k}: its lengths are not the batch's at its positions")
        seen[list(idx)] += 1
    if (seen != 1).any():
        i = int(np.flatnonzero(seen != 1)[0])
        raise HydraulisError(f"{where}: sequence {i} is in {int(seen[i])} phases, not one")


class Policy(Protocol):
    """Plans global batches on a fixed cluster with a fixed cost model."""

    name: str

    def schedule(self, lengths: np.ndarray, step: int = 0) -> Schedule: ...


@dataclass(frozen=True)
class PolicyContext:
    """What every policy is built from: the same cost model, cluster, pools and run facts.

    Pools are proposed on first use, so policies that need none (the
    homogeneous baselines, hotspa) never pay for a proposal.
    """

    cost: CostModel
    cluster: ClusterSpec
    run_max_length: int  # the longest sequence of the run (homogeneous baselines must hold it)
    sample: tuple[np.ndarray, ...]  # sample batches, for choosing configs and proposing pools
    user_pool: tuple[Deployment, ...] | None = None  # the user's pool: every pool-based policy uses it
    proposed_pool: tuple[Deployment, ...] | None = None  # a pool already proposed from this data

    @property
    def num_gpus(self) -> int:
        return self.cluster.num_gpus

    @functools.cached_property
    def pool(self) -> tuple[Deployment, ...]:
        """The planner's deployments (pool[0] the fallback): the user's, or proposed from the sample."""
        if self.user_pool is not None:
            return self.user_pool
        if self.proposed_pool is not None:
            return self.proposed_pool
        return self._propose("hydraulis")

    @functools.cached_property
    def reference_pool(self) -> tuple[Deployment, ...]:
        """The published system's own pool: its range DP, unless the user gave a pool for all."""
        if self.user_pool is not None:
            return self.user_pool
        return self._propose("published")

    def _propose(self, method: str) -> tuple[Deployment, ...]:
        from hydraulis.planner.proposal import propose

        return propose(
            self.cost, self.cluster, self.sample, method=method, max_length=self.run_max_length
        ).pool.deployments

    @classmethod
    def build(
        cls,
        cost: CostModel,
        cluster: ClusterSpec,
        batches: Sequence[np.ndarray],
        pool: Sequence[Deployment] | None = None,
        sample: Sequence[np.ndarray] | None = None,
        proposed: Sequence[Deployment] | None = None,
    ) -> PolicyContext:
        """`pool` is the user's; `proposed` one proposed beforehand; `sample` defaults to the batches."""
        sample = tuple(np.asarray(b, dtype=np.int64) for b in (sample if sample is not None else batches))
        longest = max(int(np.max(b)) for b in list(batches) + list(sample))
        return cls(
            cost,
            cluster,
            longest,
            sample,
            tuple(pool) if pool is not None else None,
            tuple(proposed) if proposed is not None else None,
        )
