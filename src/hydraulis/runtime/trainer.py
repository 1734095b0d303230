"""One training step per call: sampler -> planner -> deployment -> 1F1B -> sharded AdamW.

One `Trainer` per rank; the loop that calls it is hydraulis/training/loop.py. Each `step`:

1. takes the global batch the sampler drew (every rank draws the same
   batches from the seed, without communicating) and its plan, which rank 0
   made in a background thread while the previous iteration computed, and
   broadcasts as a compact int64 vector; only planning time that compute
   did not hide is waited for (and logged);
2. activates the plan's deployment (groups and models were built at start-up)
   and gathers the compute shard from the optimizer's owners;
3. reads only this rank's replica's documents from the corpus, packs them into
   the plan's micro-batches and runs them in 1F1B (a replica without
   micro-batches skips this and still takes part in everything else);
4. reduces gradients into the owners, clips by the global norm and steps
   AdamW; the loss (sum over all replicas and CP ranks / the batch's target
   tokens) rides in the same all-reduce as the norm.

Under context parallelism each CP rank packs only its share of every
micro-batch (`concatenate_cp_shard`); its loss and gradients cover its tokens, and
the sums over CP ranks happen in the same reduce and all-reduce.

The loss of a step is the mean over all real target tokens of the global
batch (SFT corpora: the tokens their mask marks as targets), whatever the
deployment, so runs on different deployments or world sizes see the same losses.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from hydraulis.cost.memory import RankMemory
from hydraulis.cost.model import CostModel
from hydraulis.data.sampler import GlobalBatch, TokenBudgetSampler
from hydraulis.optim import OptimSettings
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.plan import IterationPlan, Schedule
from hydraulis.runtime.deployments import RankPool
from hydraulis.runtime.divergence import finite
from hydraulis.runtime.iteration import PhaseParts, loss_part, run_phases
from hydraulis.runtime.metering.compare import Comparison, compare
from hydraulis.runtime.metering.step_memory import CPU_SAMPLE_EVERY, StepMemory
from hydraulis.runtime.metering.step_meter import StepMeter, StepMetrics, StepOutcome, clock
from hydraulis.runtime.optimizer.layout import ShardLayout
from hydraulis.runtime.optimizer.sharded import ShardedOptimizer
from hydraulis.runtime.parallelism.batch import BatchSource, Corpus
from hydraulis.runtime.parallelism.groups import built_groups
from hydraulis.runtime.parallelism.launch import DTYPES, DistEnv, init_distributed
from hydraulis.runtime.parallelism.timeouts import DEFAULT_TIMEOUT_S, first_step_timeout, settle_timeouts
from hydraulis.runtime.plan_feed import PlanFeed
from hydraulis.specs import ModelSpec


@dataclass(frozen=True)
class TrainSettings:
    """The runtime's settings, one value each (validated in training/config.py; the loop makes them from the job).

    The cost model plans and predicts what these settings run: its exchange bucket, memory budget, sequence
    parallelism and recompute set (made the job's once, training/job_cost.py) are the runtime's unless given here
    (tests, benchmarks), and `overlap` goes into it here."""

    model: ModelSpec
    pool: tuple[Deployment, ...]
    cost: CostModel
    optim: OptimSettings
    steps: int
    seed: int = 1
    dtype: str = "fp32"
    sequence_parallel: bool | None = None  # None: the cost model's
    compare_steps: int = 0  # the last batches kept for `Trainer.compare`
    exchange_bucket_bytes: int | None = None  # the most bytes one exchange buffer holds; None: the cost model's
    reduce_dtype: str = "fp32"  # what gradients travel in to their owners (summed in fp32 there)
    timeout_s: float = DEFAULT_TIMEOUT_S  # process-group timeout after the first step (parallelism/timeouts.py)
    memory_every: int = CPU_SAMPLE_EVERY  # on CPU, measure memory every this many steps (step_memory.py)
    # [parallel] memory_per_rank: each rank's measured peak is checked; None: the cost model's (None without one)
    memory_budget_bytes: int | None = None
    overlap: bool = True  # gather and reduce beside compute (runtime/optimizer/exchange.py)

    def __post_init__(self) -> None:
        memory = self.cost.memory
        given = {"sequence_parallel": memory.sequence_parallel, "exchange_bucket_bytes": memory.exchange_bucket_bytes,
                 "memory_budget_bytes": memory.budget_bytes}
        for name, value in given.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        object.__setattr__(self, "cost", self.cost.with_overlap(self.overlap))  # replica times as the exchange runs

    @property
    def recompute(self) -> frozenset[ParallelConfig]:
        """The configs whose blocks recompute activations: the cost model's set, whose caps and times count it."""
        return self.cost.recompute

    def lr_schedule_state(self) -> dict[str, Any]:
        """What the LR at each step depends on (optim.OptimSettings.lr_schedule_state)."""
        return self.optim.lr_schedule_state(self.steps)


class Trainer:
    """One rank's training (see the module docstring), made of these parts; every rank of the job builds one."""

    settings: TrainSettings
    env: DistEnv
    rank: int
    world: int
    source: BatchSource  # the sampler and the corpus reader
    control: dist.ProcessGroup | None  # plans and figures travel on it (a CPU group: NCCL cannot carry host memory)
    optimizer: ShardedOptimizer  # owns the master weights and AdamW's state; runs the exchange
    deployments: RankPool  # every deployment of the pool, built at start-up
    feed: PlanFeed  # the next batch and its schedule, planned on rank 0 a step ahead
    meter: StepMeter  # predictions, memory and metrics
    recent: deque[tuple[GlobalBatch, Schedule]]  # the last batches, for `compare`

    def __init__(
        self,
        settings: TrainSettings,
        corpus: Corpus,
        sampler: TokenBudgetSampler,
        env: DistEnv | None = None,
    ) -> None:
        self.settings = settings
        self.env = env or init_distributed()
        self.rank, self.world = self.env.rank, self.env.world_size
        self.source = BatchSource(corpus, sampler)
        timeout = first_step_timeout(settings.timeout_s)
        self.control = dist.new_group(backend="gloo", timeout=timeout) if self.env.backend != "gloo" else None
        dtype = DTYPES[settings.dtype]
        layout = ShardLayout(settings.model, self.world)
        self.optimizer = ShardedOptimizer(
            layout, self.rank, settings.optim.adamw, self.env.device, bucket_bytes=settings.exchange_bucket_bytes,
            scaled_grad=dtype != torch.float32,  # 2-byte reduced gradients under bf16 (optimizer.OwnedGradient)
        )
        self.optimizer.init(settings.seed)
        self.deployments = RankPool(
            settings.model, settings.pool, self.optimizer, dtype, self.env.device, settings.sequence_parallel,
            settings.recompute,
            timeout,
        )
        self.feed = PlanFeed(sampler, settings.pool, settings.cost, self.rank, self.world, self.control)
        memory = StepMemory(self.env.device, settings.memory_every, settings.memory_budget_bytes, self.feed.paused)
        self.meter = StepMeter(settings.cost, settings.model, self.deployments, self.world, memory, self.control)
        self.recent = deque(maxlen=settings.compare_steps)
        self._timeouts_settled = False

    @property
    def step_index(self) -> int:
        """The step this trainer runs next (the plan feed keeps it: it plans that step's batch)."""
        return self.feed.step

    # -- iterations -------------------------------------------------------------------------
    def step(self) -> StepMetrics:
        """Plan (already in flight), run and report one iteration; the next batch's planning starts at once."""
        batch, schedule, waited = self.feed.next()
        self.recent.append((batch, schedule))
        return self.run_schedule(batch, schedule, planning_unhidden_s=waited)

    def run_iteration(self, batch: GlobalBatch, plan: IterationPlan, planning_unhidden_s: float = 0.0) -> StepMetrics:
        """Execute one plan on one batch (every rank, the same plan); returns the metrics (meaningful on rank 0)."""
        return self.run_schedule(batch, Schedule.single(plan), planning_unhidden_s)

    def run_schedule(self, batch: GlobalBatch, schedule: Schedule, planning_unhidden_s: float = 0.0) -> StepMetrics:
        """Its phases one after another (runtime/iteration.py), then one optimizer step on their summed gradients."""
        indices = [self.deployments.index(p.deployment) for p in schedule.phases]
        ranks = self.meter.begin(indices, schedule, self.step_index)
        try:
            return self._run_measured(batch, schedule, indices, ranks, planning_unhidden_s)
        except BaseException:  # the memory meter's profiler and its hold on stderr end with the step
            self.meter.memory.abandon()
            raise

    def _run_measured(
        self, batch: GlobalBatch, schedule: Schedule, indices: list[int], ranks: list[RankMemory],
        planning_unhidden_s: float,
    ) -> StepMetrics:
        """run_schedule's iteration between the memory meter's start and its end."""
        s, step = self.settings, self.step_index
        start = time.perf_counter()
        targets = self.source.targets(batch)
        parts = PhaseParts(self.deployments, self.source, DTYPES[s.reduce_dtype], s.overlap)
        runs = run_phases(parts, step, batch, schedule, targets, [r.reduce_after for r in ranks])
        norm, extra = self.optimizer.global_norm(extra=loss_part(runs, self.env.device).reshape(1))
        lr = s.optim.lr_at(step, s.steps)
        values = torch.stack([norm.detach().double().cpu(), extra[0].double().cpu()]).tolist()  # one sync per step
        skipped = not finite(values[1], values[0])  # the same numbers on every rank: they agree
        self.optimizer.step(lr, norm, skip=skipped)
        finished = clock(self.env.device)  # the iteration ends here; what follows only reports on it
        for r in runs:
            r.part.clear_grads()
        outcome = StepOutcome(values[1], targets, values[0], lr, skipped, finished - start, planning_unhidden_s)
        metrics = self.meter.end(step, batch, schedule, indices, runs, outcome)
        self.feed.step += 1
        if not self._timeouts_settled:  # the first step is done: every group gets the steady timeout
            settle_timeouts(self.settings.timeout_s, [*built_groups(), self.control])
            self._timeouts_settled = True
        return metrics

    # -- measured comparison ------------------------------------------------------------------
    def compare(self, repeats: int = 3) -> Comparison | None:
        """The recent batches again, as planned and on each homogeneous deployment (runtime/metering/compare.py)."""
        return compare(self.run_schedule, self.feed, self.optimizer, list(self.recent), repeats)

    # -- the online refit ------------------------------------------------------------------------
    def use_cost(self, cost: CostModel) -> None:
        """Plan (rank 0) and predict the next batches with `cost`: the online refit's model (plan_feed.py)."""
        self.settings = replace(self.settings, cost=cost)
        self.meter.cost = self.settings.cost
        self.feed.use_cost(self.settings.cost)

    def close(self) -> None:
        self.feed.close()
