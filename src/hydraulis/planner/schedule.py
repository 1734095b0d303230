"""What every policy (the planner and the baselines) returns, a Schedule of one or more phases: its time and checks.

Most policies run a global batch on one deployment: one phase. Temporal
switching runs several phases one after another, each a deployment on part of
the batch (hotspa: homogeneous ones; the planner's phases.py: any of its pool),
and pays a switch between phases. Gradients accumulate over the phases and the
optimizer steps once. The Schedule itself is plan.py's, beside the plan and its
file and wire formats.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.cost.policies import LIGHTEST_FIRST
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.oracles.zero_bubble import defer_plan, deferral_errors
from hydraulis.planner.plan import IterationPlan, Schedule, plan_from_assignment
from hydraulis.planner.replicas import ReplicaTable
from hydraulis.planner.sim import replica_compute_s, simulate

__all__ = ["Schedule", "MemoryChoices", "check_schedule", "phase_switch_time", "mean_switch_time", "phases_time",
           "phase_compute_s", "phases_text", "schedule_text"]


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


def phase_compute_s(plan: IterationPlan, cost: CostModel) -> float:
    """A phase's simulated compute: its slowest replica's (`sim.replica_compute_s`; the phases' cost models time
    alike, a later phase's differing in its caps alone)."""
    return max(replica_compute_s(plan, cost), default=0.0)


def phases_time(phases: list[IterationPlan] | tuple[IterationPlan, ...], cost: CostModel, switch_s: float) -> float:
    """Simulated compute of each phase (`phase_compute_s`), one switch between phases, then the last phase's
    optimizer step."""
    if len(phases) == 1:
        return simulate(phases[0], cost, keep_events=False).iteration_time_s
    compute = sum(phase_compute_s(p, cost) for p in phases)
    return compute + switch_s * (len(phases) - 1) + cost.step_time(phases[-1].deployment.configs)


def check_schedule(schedule: Schedule, cost: CostModel | None = None, where: str | None = None) -> None:
    """Each sequence of the batch in exactly one phase, with its own length; each phase a valid plan
    (within its caps too if `cost` is given: a phase after the first within `CostModel.later_phase`'s, which hold
    the earlier phases' reduced gradient too). A HydraulisError names what is wrong."""
    where = where or f"step {schedule.step}"
    n = len(schedule.lengths)
    if not schedule.phases:
        raise HydraulisError(f"{where}: the schedule has no phases")
    if len(schedule.phases) != len(schedule.indices):
        raise HydraulisError(f"{where}: {len(schedule.phases)} phases but {len(schedule.indices)} index maps")
    seen = np.zeros(n, dtype=np.int64)
    for k, (plan, idx) in enumerate(zip(schedule.phases, schedule.indices, strict=True)):
        at = f"{where} phase {k}" if len(schedule.phases) > 1 else where
        plan.validate(cost.later_phase() if k and cost is not None else cost, where=at)
        held = deferral_errors(plan, cost.later_phase() if k else cost) if cost is not None else None
        if held:  # the deferred W's bytes within the room the plan's cap leaves
            raise HydraulisError(f"{at}: {held}")
        if any(not 0 <= i < n for i in idx):
            raise HydraulisError(f"{at}: a batch position outside 0..{n - 1}")
        if tuple(schedule.lengths[i] for i in idx) != plan.lengths:
            raise HydraulisError(f"{at}: its lengths are not the batch's at its positions")
        seen[list(idx)] += 1
    if (seen != 1).any():
        i = int(np.flatnonzero(seen != 1)[0])
        raise HydraulisError(f"{where}: sequence {i} is in {int(seen[i])} phases, not one")


@dataclass(frozen=True)
class MemoryChoices:
    """What the planner chose for a step's memory (cost/policies.py): each memory policy's micro-batches per
    replica (replicas phase after phase, as `StepMetrics.micro_batches`), and `alone`, the micro-batches that
    fit their policy only as their replica's only one in their phase (beside another they would need a heavier
    policy, or not fit): why a phase of its own on the same deployment, or a lighter policy, paid."""

    policies: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (policy, micro-batches per replica), lightest first
    alone: int = 0

    @staticmethod
    def of(schedule: Schedule, cost: CostModel, num_gpus: int) -> MemoryChoices:
        counts = {p: [] for p in LIGHTEST_FIRST}
        alone = 0
        for k, plan in enumerate(schedule.phases):
            phase_cost = cost.later_phase() if k else cost  # a later phase holds the earlier ones' reduced gradient
            for r, replica in enumerate(plan.replicas):
                config = plan.deployment.replicas[r].config
                ran = [phase_cost.policy_run(config, plan.policy(r, m)) for m in range(len(replica.micro_batches))]
                for p, row in counts.items():
                    row.append(ran.count(p))
                if len(ran) == 1:
                    tokens = sum(plan.lengths[i] for i in replica.micro_batches[0])
                    alone += tokens > phase_cost.policy_cap(config, num_gpus, ran[0])
        return MemoryChoices(tuple((p.label, tuple(row)) for p, row in counts.items() if any(row)), alone)

    @property
    def totals(self) -> dict[str, int]:
        """Micro-batches per memory policy, over the replicas."""
        return {label: sum(row) for label, row in self.policies}

    def to_dict(self) -> dict:
        return {"policies": {label: list(row) for label, row in self.policies}, "alone": self.alone}


def phase_runs(names: Sequence[str]) -> list[tuple[str, int]]:
    """A schedule's deployments phase after phase as (deployment, consecutive phases on it)."""
    return [(name, len(list(group))) for name, group in itertools.groupby(names)]


def phases_text(names: Sequence[str], alone: int) -> str:
    """A schedule's deployments phase after phase for a person (`hydraulis train`'s step lines, `plan` and
    `simulate`): consecutive phases on one deployment as `N phases of D` (the runs joined by `, then `), and why:
    the planner keeps them apart only where one phase on it simulated slower or had no room (planner/phases.py's
    `_merged`), which micro-batches that fit only alone (`alone`, `MemoryChoices`) make so."""
    runs = phase_runs(names)
    if all(n == 1 for _, n in runs):
        return " | ".join(names)
    text = ", then ".join(name if n == 1 else f"{n} phases of {name}" for name, n in runs)
    return text + (f" (memory: {alone} micro-batch(es) fit only as their replica's only one)" if alone
                   else " (simulated faster than one phase)")


def schedule_text(schedule: Schedule, cost: CostModel, num_gpus: int) -> str:
    """`phases_text` of a schedule planned on `cost` for `num_gpus` (the memory counted only where it is said)."""
    names = [str(p.deployment) for p in schedule.phases]
    repeated = len(phase_runs(names)) < len(names)
    return phases_text(names, MemoryChoices.of(schedule, cost, num_gpus).alone if repeated else 0)


def assemble(
    step: int, lengths: np.ndarray, deployment: Deployment, micro_batches: Sequence[Sequence[Sequence[int]]],
    table: ReplicaTable,
) -> IterationPlan:
    """The plan of these micro-batches, each with its memory policy (`ReplicaCost.policy`; a replica whose every
    micro-batch runs the plain one lists none)."""
    lengths = np.asarray(lengths)
    policies = [replica.policies_of([int(lengths[np.asarray(mb, dtype=np.int64)].sum()) for mb in mbs])
                for replica, mbs in zip(table.replicas, micro_batches, strict=True)]
    return plan_from_assignment(step, lengths, deployment, micro_batches, 0.0, policies=policies)


def finalize(
    step: int, lengths: np.ndarray, deployment: Deployment, micro_batches: Sequence[Sequence[Sequence[int]]],
    cost: CostModel, started: float, table: ReplicaTable | None = None, zero_bubble: bool = False,
) -> IterationPlan:
    """A validated IterationPlan whose predicted time is the simulator's, and whose planning time ends now.

    Every sequence exactly once and every micro-batch within its replica's cap, else a HydraulisError.
    `table`: the deployment's on `cost`, where the caller has it (building one reads every policy's caps).
    `zero_bubble`: each replica's weight gradients deferred into its stages' gaps where that simulates faster
    (`oracles.zero_bubble.defer_plan`), its predicted time that order's.
    """
    table = ReplicaTable.of(cost, deployment, deployment.num_gpus) if table is None else table
    plan = assemble(step, lengths, deployment, micro_batches, table)
    plan.validate(cost, deployment.num_gpus, where=f"step {step}")
    if zero_bubble:
        plan = defer_plan(plan, cost)
    predicted = simulate(plan, cost, keep_events=False)
    return dataclasses.replace(plan, predicted_time_s=predicted.iteration_time_s,
                               replica_predicted_s=tuple(float(t) for t in predicted.replica_times_s),
                               planning_time_s=time.perf_counter() - started)
