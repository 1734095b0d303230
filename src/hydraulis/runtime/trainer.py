"""One training step per call: sampler -> planner -> deployment -> 1F1B -> sharded AdamW.

One `Trainer` per rank; the run that calls it is hydraulis/training/run.py. Each `step`:

1. takes the global batch the sampler drew (every rank draws the same
   batches from the seed, without communicating) and its plan, which rank 0
   made in a background thread while the previous iteration computed (where
   CPU ranks fill the cores: when this step began, the others waiting), and
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
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hydraulis.cost.conditions import cpu_cores, spare_core
from hydraulis.cost.memory import RankMemory
from hydraulis.cost.model import CostModel
from hydraulis.data.sampler import GlobalBatch, TokenBudgetSampler
from hydraulis.planner.phases import PhasedPlanner
from hydraulis.planner.plan import IterationPlan, Schedule
from hydraulis.runtime.deployments import BuiltDeployments
from hydraulis.runtime.divergence import finite
from hydraulis.runtime.iteration import PhaseParts, WeightSlots, loss_part, run_phases
from hydraulis.runtime.metering.compare import Comparison, compare
from hydraulis.runtime.metering.step_memory import StepMemory
from hydraulis.runtime.metering.step_meter import StepMeter, StepMetrics, StepOutcome, clock
from hydraulis.runtime.optimizer.layout import ShardLayout
from hydraulis.runtime.optimizer.sharded import ShardedOptimizer
from hydraulis.runtime.parallelism.batch import BatchSource, Corpus
from hydraulis.runtime.parallelism.groups import built_groups
from hydraulis.runtime.parallelism.launch import DTYPES, DistEnv, init_distributed
from hydraulis.runtime.parallelism.timeouts import first_step_timeout, settle_timeouts
from hydraulis.runtime.plan_feed import PlanFeed
from hydraulis.settings import TrainerSettings


@dataclass(frozen=True)
class StepSums:
    """The job-wide numbers of a step, read back in one sync: the loss sum over every replica and CP rank, and the
    global gradient norm (they ride in one all-reduce: ShardedOptimizer.global_norm)."""

    loss_sum: float
    grad_norm: float

    @classmethod
    def read(cls, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> StepSums:
        loss, norm = torch.stack([loss_sum.double().cpu(), grad_norm.detach().double().cpu()]).tolist()
        return cls(loss_sum=loss, grad_norm=norm)

    @property
    def finite(self) -> bool:
        """Whether the step may update the weights (the same numbers on every rank: they agree)."""
        return finite(self.loss_sum, self.grad_norm)


class Trainer:
    """One rank's training (see the module docstring), made of these parts; every rank of the job builds one."""

    settings: TrainerSettings
    env: DistEnv
    rank: int
    world: int
    source: BatchSource  # the sampler and the corpus reader
    control: dist.ProcessGroup | None  # plans and figures travel on it (a CPU group: NCCL cannot carry host memory)
    optimizer: ShardedOptimizer  # owns the master weights and AdamW's state; runs the exchange
    deployments: BuiltDeployments  # every deployment of the pool, built at start-up
    feed: PlanFeed  # the next batch and its schedule, planned on rank 0 a step ahead
    meter: StepMeter  # predictions, memory and metrics
    recent: deque[tuple[GlobalBatch, Schedule]]  # the last batches, for `compare`
    weight_slots: WeightSlots | None  # where each stage's W's run (zero-bubble, iteration.py); None: the plan's

    def __init__(
        self,
        settings: TrainerSettings,
        corpus: Corpus,
        sampler: TokenBudgetSampler,
        env: DistEnv | None = None,
        weight_slots: WeightSlots | None = None,
    ) -> None:
        self.settings = settings
        self.weight_slots = weight_slots
        self.env = env or init_distributed()
        self.rank = self.env.rank
        self.world = self.env.world_size
        self.source = BatchSource(corpus, sampler)
        model, parallel, train = settings.model, settings.parallel, settings.train
        timeout = first_step_timeout(train.timeout_s)
        self.control = dist.new_group(backend="gloo", timeout=timeout) if self.env.backend != "gloo" else None
        dtype = DTYPES[train.dtype]
        self.optimizer = ShardedOptimizer(
            ShardLayout(model, self.world), self.rank, settings.optim.adamw, self.env.device,
            bucket_bytes=parallel.exchange_bucket_bytes,
            scaled_grad=dtype != torch.float32,  # 2-byte reduced gradients under bf16 (optimizer.OwnedGradient)
        )
        self.optimizer.init(train.seed)
        self.deployments = BuiltDeployments(
            spec=model, pool=parallel.pool, optimizer=self.optimizer, dtype=dtype, device=self.env.device,
            sequence_parallel=parallel.sequence_parallel, timeout=timeout,
        )
        ahead = self.env.device.type != "cpu" or spare_core(self.world, torch.get_num_threads(), cpu_cores())
        self.feed = PlanFeed(sampler=sampler, pool=parallel.pool, cost=parallel.cost, rank=self.rank, world=self.world,
                             control=self.control, ahead=ahead, zero_bubble=parallel.zero_bubble)
        memory = StepMemory(self.env.device, train.memory_every, parallel.memory_budget_bytes, self.feed.paused)
        self.meter = StepMeter(cost=parallel.cost, model=model, pool=self.deployments, world=self.world, memory=memory,
                               control=self.control)
        self.recent = deque(maxlen=train.compare_steps)
        self.settled = False  # whether the groups have the steady timeout (after the first step)

    @property
    def step_index(self) -> int:
        """The step this trainer runs next (the plan feed keeps it: it plans that step's batch)."""
        return self.feed.step

    @property
    def last_batch(self) -> GlobalBatch | None:
        """The batch of the last step (a mixture's run log counts its sources)."""
        return self.feed.last

    @property
    def planner(self) -> PhasedPlanner | None:
        """Rank 0's planner (None on the other ranks): the run's summary reads its outlook."""
        return self.feed.planner

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
            metrics = self._run_measured(batch, schedule, indices, ranks, planning_unhidden_s)
        except BaseException:  # the memory meter's profiler and its hold on stderr end with the step
            self.meter.memory.abandon()
            raise
        if not self.settled:  # the first step is done: every group gets the steady timeout (parallelism/timeouts.py)
            settle_timeouts(self.settings.train.timeout_s, [*built_groups(), self.control])
            self.settled = True
        return metrics

    def _run_measured(
        self, batch: GlobalBatch, schedule: Schedule, indices: list[int], ranks: list[RankMemory],
        planning_unhidden_s: float,
    ) -> StepMetrics:
        """run_schedule's iteration between the memory meter's start and its end."""
        s, step = self.settings, self.step_index
        start = time.perf_counter()
        targets = self.source.targets(batch)
        parts = PhaseParts(pool=self.deployments, source=self.source, reduce_dtype=DTYPES[s.train.reduce_dtype],
                           overlap=s.parallel.overlap, cost=s.parallel.cost, weight_slots=self.weight_slots)
        runs = run_phases(parts=parts, step=step, batch=batch, schedule=schedule, targets=targets,
                          reduce_after=[r.reduce_after for r in ranks])
        norm, extra = self.optimizer.global_norm(extra=loss_part(runs, self.env.device).reshape(1))
        lr = s.optim.lr_at(step, s.train.steps)
        sums = StepSums.read(extra[0], norm)  # one sync per step
        skipped = not sums.finite  # the same numbers on every rank: they agree
        self.optimizer.step(lr, norm, skip=skipped)
        finished = clock(self.env.device)  # the iteration ends here; what follows only reports on it
        for r in runs:
            r.part.clear_grads()
        outcome = StepOutcome(
            loss_sum=sums.loss_sum, targets=targets, grad_norm=sums.grad_norm, lr=lr, skipped=skipped,
            iteration_s=finished - start, planning_unhidden_s=planning_unhidden_s,
        )
        metrics = self.meter.end(step=step, batch=batch, schedule=schedule, indices=indices, runs=runs, outcome=outcome)
        self.feed.step += 1
        return metrics

    # -- measured comparison ------------------------------------------------------------------
    def compare(self, repeats: int = 3) -> Comparison | None:
        """The recent batches again, as planned and on each homogeneous deployment (runtime/metering/compare.py)."""
        return compare(self.run_schedule, self.feed, self.optimizer, list(self.recent), repeats)

    # -- the online refit ------------------------------------------------------------------------
    def use_cost(self, cost: CostModel) -> None:
        """Plan (rank 0) and predict the next batches with `cost`: the online refit's model (plan_feed.py)."""
        self.settings = self.settings.with_cost(cost)
        self.meter.cost = self.settings.parallel.cost
        self.feed.use_cost(self.settings.parallel.cost)

    def close(self) -> None:
        self.feed.close()
