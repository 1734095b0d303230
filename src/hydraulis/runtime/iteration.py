"""The compute of an iteration, phase by phase: each phase its deployment on its part of the batch.

A plan of one phase is what every iteration was before phases existed: activate
the deployment, gather the compute shard (overlapped with forward), run 1F1B
(interleaved where the replica has vp > 1) on this rank's micro-batches, reduce the gradients into the owners. A phased
schedule (planner/phases.py) repeats that per phase on the same fixed optimizer
layout, and the owners add each later phase's gradients to what the earlier
phases reduced (`ReduceStream`'s `accumulate`); the trainer then takes the
global norm and one AdamW step over the sum. Every phase's loss is summed over
the whole batch's targets, so the loss is the single-process one.

A phase change costs what a switch between iterations costs: freeing the old
compute shard and allocating the new one, the reduce of the phase's gradients
and the gather into the next layout. `PhaseRun.switch_s` is what the training
thread spent on that (activation, and the exchange time compute did not hide)
beyond what one phase would have spent: the in-iteration switch cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hydraulis.cost.model import CostModel
from hydraulis.data.sampler import GlobalBatch
from hydraulis.planner.plan import IterationPlan, Schedule
from hydraulis.runtime.deployments import BuiltDeployments, RankDeployment
from hydraulis.runtime.divergence import poisoned
from hydraulis.runtime.optimizer.exchange import Exchange
from hydraulis.runtime.parallelism.batch import BatchSource
from hydraulis.runtime.pipeline.step import StepResult, train_step


@dataclass(frozen=True)
class PhaseRun:
    """What one phase did on this rank (times in seconds, from the phase's start)."""

    index: int  # the deployment's index in the pool
    plan: IterationPlan
    part: RankDeployment
    result: StepResult
    exchange: Exchange  # its gather and reduce
    switched: bool  # another deployment than the one before (the previous iteration's, or phase's)
    activate_s: float
    gather_s: float  # the gather before compute (all of it without overlap or on a pipeline)
    compute_s: float
    reduce_s: float  # the reduce after compute, waiting for the slowest replica included

    def switch_s(self, first: bool, last: bool) -> float:
        """This phase's share of the in-iteration switch cost: its activation and exposed gather unless it is the
        first phase, its exposed reduce unless it is the last (one phase pays neither)."""
        gather = 0.0 if first else self.activate_s + self.exchange.gather.exposed_s
        return gather + (0.0 if last else self.exchange.reduce.exposed_s)


def sub_batch(batch: GlobalBatch, positions: Sequence[int]) -> GlobalBatch:
    """The pieces of `batch` at `positions`, in that order (a phase's part of the batch)."""
    idx = np.asarray(positions, dtype=np.int64)
    return GlobalBatch(batch.docs[idx], batch.starts[idx], batch.lengths[idx], batch.state, batch.next_state)


# A stage's deferred weight gradients (zero-bubble W slots, `pipeline_order.with_weights`) in a phase's plan:
# (plan, replica, stage) -> slots; empty: fused. `plan_slots`, the plan's own, unless a caller gives another rule.
WeightSlots = Callable[[IterationPlan, int, int], Sequence[int]]


@dataclass(frozen=True)
class PhaseParts:
    """What the phases of an iteration run on: this rank's deployments, the batches' source, how gradients
    travel to their owners (`reduce_dtype`; beside compute unless `overlap` is off), the plans' cost model (what
    a micro-batch whose plan lists no memory policy runs), where a stage's W's run (None: where the plan says)."""

    pool: BuiltDeployments
    source: BatchSource
    reduce_dtype: torch.dtype
    overlap: bool
    cost: CostModel
    weight_slots: WeightSlots | None = None


def plan_slots(plan: IterationPlan, replica: int, stage: int) -> tuple[int, ...]:
    """The slots the planner chose for this stage (`ReplicaPlan.deferral`; empty: fused)."""
    deferral = plan.replicas[replica].deferral
    return deferral[stage] if deferral else ()


def run_phases(
    parts: PhaseParts, step: int, batch: GlobalBatch, schedule: Schedule, targets: int, reduce_after: Sequence[int]
) -> list[PhaseRun]:
    """Every phase in order; each later one's reduce accumulates into the owners' gradient. `reduce_after`: each
    phase's blocks this rank's backward frees before its reduce starts (cost/memory.py's `reduce_wait`)."""
    runs = []
    for k, (plan, positions) in enumerate(zip(schedule.phases, schedule.indices, strict=True)):
        part_batch = batch if len(schedule.phases) == 1 else sub_batch(batch, positions)
        runs.append(run_phase(parts, step, part_batch, plan, targets, accumulate=k > 0, reduce_after=reduce_after[k]))
    return runs


def run_phase(
    parts: PhaseParts, step: int, batch: GlobalBatch, plan: IterationPlan, targets: int, accumulate: bool,
    reduce_after: int = 1,
) -> PhaseRun:
    """One deployment's part of an iteration: activate, gather, 1F1B on this rank's micro-batches, reduce."""
    pool = parts.pool
    index = pool.index(plan.deployment)
    start = time.perf_counter()
    part, switched = pool.activate(index)
    activated = time.perf_counter()
    model = part.model
    part.clear_grads()
    count = len(plan.replicas[part.replica].micro_batches)
    exchange = pool.exchange(part, micro_batches=count, reduce_dtype=parts.reduce_dtype, overlap=parts.overlap,
                             accumulate=accumulate, reduce_after=reduce_after)
    gathered = time.perf_counter()
    micro_batches = parts.source.micro_batches(batch, plan, part.replica, part.groups, parts.cost)
    slots = (parts.weight_slots or plan_slots)(plan, part.replica, part.groups.stage)
    # poisoned: a test hook, off unless asked for
    with part.exchanging(exchange), poisoned(model, step, part.groups.is_last_stage):
        result = train_step(model, part.groups, micro_batches, targets, reduce_partial_grads=False, deferred=slots)
    if pool.device.type == "cuda":
        torch.cuda.synchronize()
    computed = time.perf_counter()
    exchange.finish()
    reduced = time.perf_counter()
    return PhaseRun(index=index, plan=plan, part=part, result=result, exchange=exchange, switched=switched,
                    activate_s=activated - start, gather_s=gathered - activated, compute_s=computed - gathered,
                    reduce_s=reduced - computed)


def loss_part(runs: Sequence[PhaseRun], device: torch.device) -> torch.Tensor:
    """This rank's share of the batch's loss sum: each phase's last stage, counted on its TP rank 0."""
    total = torch.zeros((), device=device)
    for run in runs:
        if run.result.loss_sum_tensor is not None and run.part.groups.tp.rank == 0:
            total = total + run.result.loss_sum_tensor
    return total


def switch_cost(runs: Sequence[PhaseRun]) -> float:
    """The in-iteration switch cost on this rank (0 for one phase)."""
    return sum(r.switch_s(k == 0, k == len(runs) - 1) for k, r in enumerate(runs))
