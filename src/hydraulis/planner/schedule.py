"""What every policy (the planner and the baselines) returns: a Schedule of one or more phases.

Most policies run a global batch on one deployment: one phase. Temporal
switching (hotspa) runs several phases one after another, each a homogeneous
deployment over the whole cluster on part of the batch, and pays a switch
between phases. Gradients accumulate over the phases and are synchronised once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.errors import HydraulisError
from hydraulis.planner.plan import IterationPlan
from hydraulis.planner.sim import simulate


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
