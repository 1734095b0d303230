"""What an iteration reports: its predictions, its memory and its figures over the ranks, as `StepMetrics`.

The predicted times travel with the schedule: the planner simulated them
with the trainer's cost model (planner.finalize, planner/phases.py), so the
runtime simulates nothing. Memory is measured and predicted per rank
(step_memory.py); the figures of every rank travel in one all-reduce over
the control group (`RankFigures`), and rank 0 reports the largest.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist

from hydraulis.cost.memory import RankMemory
from hydraulis.cost.model import CostModel
from hydraulis.data.sampler import GlobalBatch
from hydraulis.planner.plan import Schedule
from hydraulis.planner.schedule import MemoryChoices
from hydraulis.runtime.deployments import BuiltDeployments
from hydraulis.runtime.iteration import PhaseRun, switch_cost
from hydraulis.runtime.metering.step_memory import MemoryFigures, StepMemory, predicted_rank
from hydraulis.specs import ModelSpec


@dataclass(frozen=True)
class StepMetrics:
    """One iteration as rank 0 reports it (times in seconds)."""

    step: int
    loss: float
    tokens: int
    sequences: int
    deployment: str
    deployment_index: int
    switched: bool
    iteration_s: float
    predicted_s: float
    planning_s: float  # the planner's own time for this batch (behind the previous iteration where it plans ahead)
    planning_unhidden_s: float  # what the iteration waited for it
    switch_s: float  # activating another deployment (freeing and allocating compute shards)
    gather_s: float  # the gather before compute (all of it without overlap or on a pipeline; else nothing)
    reduce_s: float  # the reduce after compute: includes waiting for the slowest replica, not only the exchange
    lr: float
    grad_norm: float
    replica_s: tuple[float, ...]
    replica_predicted_s: tuple[float, ...]
    micro_batches: tuple[int, ...]
    epoch: int
    position: int
    skipped: bool = False  # a non-finite loss or gradient norm: the optimizer did not step (divergence.py)
    # Bytes, the largest over ranks (runtime/metering/step_memory.py): measured by the allocator, and predicted.
    # None: not measured (CPU measures a sample of the steps), never a zero that reads as a measurement.
    memory_peak_bytes: int | None = None
    memory_predicted_bytes: int = 0
    exchange_peak_bytes: int | None = None
    memory_error: float | None = None  # the largest |measured - predicted| / predicted of any rank
    # Seconds the exchange held the training thread (packing, unpacking, waiting) that compute did not hide
    # (runtime/optimizer/exchange.py): the largest of any rank, which includes waiting for the slowest replica, and the
    # smallest, the slowest rank's, which is the exchange alone.
    exchange_exposed_s: float = 0.0
    exchange_exposed_min_s: float = 0.0
    phases: int = 1  # deployments one after another in this iteration (runtime/iteration.py)
    phase_switch_s: float = 0.0  # their switches, measured (the rank that waited least: the switches alone)
    phase_switch_predicted_s: float = 0.0
    memory_over_budget: bool = False  # a rank's measured peak exceeded [parallel] memory_per_rank
    deployment_indices: tuple[int, ...] = ()  # each phase's deployment in the pool: replica_s follows them
    memory_choices: MemoryChoices = MemoryChoices()  # each micro-batch's memory policy; those that fit only alone
    deferred_replicas: int = 0  # replicas whose plan defers weight gradients to pipeline gaps ([parallel] zero_bubble)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.iteration_s if self.iteration_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["replica_s"] = list(self.replica_s)
        d["replica_predicted_s"] = list(self.replica_predicted_s)
        d["micro_batches"] = list(self.micro_batches)
        d["memory_choices"] = self.memory_choices.to_dict()
        d["tokens_per_s"] = self.tokens_per_s
        return d


@dataclass(frozen=True)
class RankFigures:
    """An iteration's figures on one rank; `across_ranks` makes each the largest over ranks, the `_min` ones the
    smallest (they travel negated), in one all-reduce over the control group."""

    replica_s: tuple[float, ...]  # compute seconds of each replica of each phase, phase after phase (0: not ours)
    memory_peak: float  # bytes (runtime/metering/step_memory.py)
    memory_predicted: float
    exchange_peak: float
    memory_error: float
    exposed_s: float  # the exchange's time compute did not hide (exchange.py)
    exposed_min_s: float
    switch_s: float  # the in-iteration switch cost (`switch_cost`)
    switch_min_s: float

    @staticmethod
    def of(runs: Sequence[PhaseRun], memory: MemoryFigures) -> RankFigures:
        replica_s: list[float] = []
        for run in runs:
            times = [0.0] * len(run.plan.deployment.replicas)
            times[run.part.replica] = run.compute_s
            replica_s += times
        exposed, switch = sum(r.exchange.exposed_s for r in runs), switch_cost(runs)
        return RankFigures(replica_s=tuple(replica_s), memory_peak=memory.peak, memory_predicted=memory.predicted,
                           exchange_peak=memory.exchange_peak, memory_error=memory.error, exposed_s=exposed,
                           exposed_min_s=exposed, switch_s=switch, switch_min_s=switch)

    def across_ranks(self, group: dist.ProcessGroup | None) -> RankFigures:
        names = [f.name for f in fields(self) if f.name != "replica_s"]
        signs = [-1.0 if name.endswith("_min_s") else 1.0 for name in names]
        values = torch.tensor([*self.replica_s, *(s * getattr(self, n) for n, s in zip(names, signs, strict=True))],
                              dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        out, k = values.tolist(), len(self.replica_s)
        return RankFigures(tuple(out[:k]), **{n: s * v for n, s, v in zip(names, signs, out[k:], strict=True)})


@dataclass(frozen=True)
class StepOutcome:
    """What the optimizer step made of an iteration (every rank agrees on it)."""

    loss_sum: float
    targets: int
    grad_norm: float
    lr: float
    skipped: bool
    iteration_s: float
    planning_unhidden_s: float


class StepMeter:
    """Predicts and measures each iteration on this rank and reports it over all ranks.

    `runs` and `mine` keep this rank's own phase runs and figures of the last iteration (the metrics carry the
    largest over ranks): what a benchmark of one rank's exchange or memory reads."""

    def __init__(
        self, cost: CostModel, model: ModelSpec, pool: BuiltDeployments, world: int, memory: StepMemory,
        control: dist.ProcessGroup | None,
    ) -> None:
        self.cost = cost
        self.model = model
        self.pool = pool
        self.world = world
        self.memory = memory
        self.control = control
        self.runs: tuple[PhaseRun, ...] = ()
        self.mine: RankFigures | None = None

    def begin(self, indices: Sequence[int], schedule: Schedule, step: int) -> list[RankMemory]:
        """This rank's predicted memory in each phase (a later one holds the earlier phases' reduced gradient);
        the meter started if the iteration is due; on CPU every rank then waits for the others.

        Why the wait: a CPU rank that measures takes a census of its live tensors first (90-250 ms on tiny,
        its own decision), and without it rank 0's clock, and every replica waiting on that rank in a
        collective, counted the census as training: the demo's measured steps ran 18% over their prediction,
        the others 5%."""
        pool = self.pool
        ranks = [predicted_rank(self.cost.later_phase() if n else self.cost, self.model, pool.parts[k], p,
                                world=self.world, dtype=pool.dtype, bucket_bytes=pool.optimizer.bucket_bytes)
                 for n, (k, p) in enumerate(zip(indices, schedule.phases, strict=True))]
        self.memory.start(indices[0], step, max(r.peak for r in ranks))
        if pool.device.type == "cpu" and self.world > 1:
            dist.barrier(group=self.control)
        return ranks

    def end(
        self, step: int, batch: GlobalBatch, schedule: Schedule, indices: Sequence[int], runs: Sequence[PhaseRun],
        outcome: StepOutcome,
    ) -> StepMetrics:
        """The iteration's metrics (meaningful on rank 0), its figures the largest over ranks."""
        memory = self.memory.stop(max(r.exchange.buffer_bytes for r in runs))
        self.runs = tuple(runs)
        self.mine = RankFigures.of(runs, memory)
        figures = self.mine.across_ranks(self.control)
        # Each replica's prediction travels with its plan (planner.finalize); a plan made by hand without one: 0.
        predicted = [p.replica_predicted_s or (0.0,) * len(p.replicas) for p in schedule.phases]
        measured = figures.memory_peak > 0  # some rank measured this step's memory
        budget = self.memory.budget
        return StepMetrics(
            step=step, loss=outcome.loss_sum / outcome.targets, tokens=batch.num_tokens, sequences=len(batch),
            deployment=" | ".join(str(p.deployment) for p in schedule.phases), deployment_index=runs[-1].index,
            switched=runs[0].switched, iteration_s=outcome.iteration_s,
            predicted_s=schedule.iteration_time_s,
            planning_s=schedule.planning_time_s, planning_unhidden_s=outcome.planning_unhidden_s,
            switch_s=runs[0].activate_s, gather_s=sum(r.gather_s for r in runs),
            reduce_s=sum(r.reduce_s for r in runs), lr=outcome.lr, grad_norm=outcome.grad_norm,
            replica_s=figures.replica_s, replica_predicted_s=tuple(float(t) for times in predicted for t in times),
            micro_batches=tuple(len(r.micro_batches) for p in schedule.phases for r in p.replicas),
            epoch=batch.state.epoch, position=batch.state.position, skipped=outcome.skipped,
            memory_peak_bytes=int(figures.memory_peak) if measured else None,
            memory_predicted_bytes=int(figures.memory_predicted),
            exchange_peak_bytes=int(figures.exchange_peak) if measured else None,
            memory_error=figures.memory_error if measured else None,
            exchange_exposed_s=figures.exposed_s, exchange_exposed_min_s=figures.exposed_min_s,
            phases=len(runs), phase_switch_s=figures.switch_min_s,
            phase_switch_predicted_s=schedule.switch_s * (len(runs) - 1),
            memory_over_budget=budget is not None and figures.memory_peak > budget,
            deployment_indices=tuple(indices),
            memory_choices=MemoryChoices.of(schedule, self.cost, self.world),
            deferred_replicas=sum(bool(r.deferral) for p in schedule.phases for r in p.replicas),
        )


def clock(device: torch.device) -> float:
    """Now, after the device's queued work (an iteration ends when its optimizer step has run)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()
