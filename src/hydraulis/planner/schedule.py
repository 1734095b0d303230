"""What every policy (the planner and the baselines) returns, a Schedule of one or more phases: its time and checks.

Most policies run a global batch on one deployment: one phase. Temporal
switching runs several phases one after another, each a deployment on part of
the batch (hotspa: homogeneous ones; the planner's phases.py: any of its pool),
and pays a switch between phases. Gradients accumulate over the phases and the
optimizer steps once. The Schedule itself is plan.py's, beside the plan and its
file and wire formats.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.errors import HydraulisError
from hydraulis.parallel import ParallelConfig
from hydraulis.planner.plan import IterationPlan, Schedule
from hydraulis.planner.sim import simulate

__all__ = ["Schedule", "check_schedule", "phase_switch_time", "mean_switch_time", "phases_time"]


def phase_switch_time(
    cost: CostModel,
    num_gpus: int,
    before: Sequence[ParallelConfig] | None = None,
    after: Sequence[ParallelConfig] | None = None,
) -> float:
    """A phase change inside an iteration on the owner shards: one more exchange.

    The leaving deployment's gradients are reduced into their owners (which accumulate them) and the
    next deployment's compute shard is gathered: a gradient sync's reduce and gather, nothing of the
    optimizer state moves (docs/design.md, section 5). Timed as the profile measured them for the
    configs of the deployment before and after (CostModel.exchange_time); without them, for the
    slowest measured config.
    """
    return cost.exchange_time(before, after, num_gpus)


def mean_switch_time(phases: Sequence[IterationPlan], cost: CostModel) -> float:
    """A schedule's switch cost per phase change (Schedule.switch_s): the mean over its changes, 0 for one phase."""
    if len(phases) < 2:
        return 0.0
    num_gpus = phases[0].deployment.num_gpus
    return sum(phase_switch_time(cost, num_gpus, a.deployment.configs, b.deployment.configs)
               for a, b in zip(phases, phases[1:], strict=False)) / (len(phases) - 1)


def phases_time(phases: list[IterationPlan] | tuple[IterationPlan, ...], cost: CostModel, switch_s: float) -> float:
    """Simulated compute of each phase, one switch between phases, then the last phase's optimizer step."""
    if len(phases) == 1:
        return simulate(phases[0], cost, keep_events=False).iteration_time_s
    compute = sum(simulate(p, cost, keep_events=False).compute_time_s for p in phases)
    return compute + switch_s * (len(phases) - 1) + cost.step_time(phases[-1].deployment.configs)


def check_schedule(schedule: Schedule, cost: CostModel | None = None, where: str | None = None) -> None:
    """Each sequence of the batch in exactly one phase, with its own length; each phase a valid plan
    (within its caps too if `cost` is given). A HydraulisError names what is wrong."""
    where = where or f"step {schedule.step}"
    n = len(schedule.lengths)
    if not schedule.phases:
        raise HydraulisError(f"{where}: the schedule has no phases")
    if len(schedule.phases) != len(schedule.indices):
        raise HydraulisError(f"{where}: {len(schedule.phases)} phases but {len(schedule.indices)} index maps")
    seen = np.zeros(n, dtype=np.int64)
    for k, (plan, idx) in enumerate(zip(schedule.phases, schedule.indices, strict=True)):
        at = f"{where} phase {k}" if len(schedule.phases) > 1 else where
        plan.validate(cost, where=at)
        if any(not 0 <= i < n for i in idx):
            raise HydraulisError(f"{at}: a batch position outside 0..{n - 1}")
        if tuple(schedule.lengths[i] for i in idx) != plan.lengths:
            raise HydraulisError(f"{at}: its lengths are not the batch's at its positions")
        seen[list(idx)] += 1
    if (seen != 1).any():
        i = int(np.flatnonzero(seen != 1)[0])
        raise HydraulisError(f"{where}: sequence {i} is in {int(seen[i])} phases, not one")
