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
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hydraulis.cost.memory import RankMemory
from hydraulis.cost.model import CostModel
from hydraulis.data.sampler import GlobalBatch, SamplerState, TokenBudgetSampler
from hydraulis.errors import HydraulisError
from hydraulis.limits import DEFAULT_EXCHANGE_BUCKET_BYTES
from hydraulis.optim import OptimSettings
from hydraulis.parallel import Deployment
from hydraulis.planner.phases import PhasedPlanner
from hydraulis.planner.plan import IterationPlan, Schedule, decode_schedule, encode_schedule
from hydraulis.planner.pool import check_job_pool
from hydraulis.planner.schedule import phases_time
from hydraulis.planner.sim import simulate
from hydraulis.runtime.compare import Comparison, compare
from hydraulis.runtime.deployments import RankDeployment, RankPool
from hydraulis.runtime.divergence import finite
from hydraulis.runtime.launch import DTYPES, DistEnv, init_distributed
from hydraulis.runtime.optimizer.exchange import Exchange
from hydraulis.runtime.optimizer.layout import ShardLayout
from hydraulis.runtime.optimizer.sharded import ShardedOptimizer
from hydraulis.runtime.parallelism.batch import Corpus, MicroBatchInput, concatenate_cp_shard
from hydraulis.runtime.parallelism.groups import built_groups
from hydraulis.runtime.phases import RankFigures, loss_part, run_phases
from hydraulis.runtime.step_memory import CPU_SAMPLE_EVERY, MemoryFigures, StepMemory, predicted_rank
from hydraulis.runtime.timeouts import DEFAULT_TIMEOUT_S, first_step_timeout, settle_timeouts
from hydraulis.specs import ModelSpec


@dataclass(frozen=True)
class TrainSettings:
    model: ModelSpec
    pool: tuple[Deployment, ...]
    cost: CostModel
    optim: OptimSettings
    steps: int
    seed: int = 1
    dtype: str = "fp32"
    sequence_parallel: bool = False
    compare_steps: int = 0  # the last batches kept for `Trainer.compare`
    exchange_bucket_bytes: int = DEFAULT_EXCHANGE_BUCKET_BYTES  # the most bytes one exchange buffer holds
    reduce_dtype: str = "fp32"  # what gradients travel in to their owners (summed in fp32 there)
    timeout_s: float = DEFAULT_TIMEOUT_S  # process-group timeout after the first step (timeouts.py)
    memory_every: int = CPU_SAMPLE_EVERY  # on CPU, measure memory every this many steps (step_memory.py)
    memory_budget_bytes: int | None = None  # [parallel] memory_per_rank: each rank's measured peak is checked
    overlap: bool = True  # gather and reduce beside compute (runtime/optimizer/exchange.py)

    def lr_schedule_state(self) -> dict[str, Any]:
        """What the LR at each step depends on (optim.OptimSettings.lr_schedule_state)."""
        return self.optim.lr_schedule_state(self.steps)

    def __post_init__(self) -> None:
        for key in ("dtype", "reduce_dtype"):
            if getattr(self, key) not in DTYPES:
                raise HydraulisError(f"unknown {key} {getattr(self, key)!r}; use one of {', '.join(DTYPES)}")
        if self.steps < 0:
            raise HydraulisError(f"steps must be non-negative, got {self.steps}")


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
    planning_s: float  # the planner's own time for this batch (hidden behind the previous iteration)
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
    # Bytes, the largest over ranks (runtime/step_memory.py): measured by the allocator, and predicted.
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
    phases: int = 1  # deployments one after another in this iteration (runtime/phases.py)
    phase_switch_s: float = 0.0  # their switches, measured (the rank that waited least: the switches alone)
    phase_switch_predicted_s: float = 0.0
    memory_over_budget: bool = False  # a rank's measured peak exceeded [parallel] memory_per_rank
    deployment_indices: tuple[int, ...] = ()  # each phase's deployment in the pool: replica_s follows them

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.iteration_s if self.iteration_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["replica_s"] = list(self.replica_s)
        d["replica_predicted_s"] = list(self.replica_predicted_s)
        d["micro_batches"] = list(self.micro_batches)
        d["tokens_per_s"] = self.tokens_per_s
        return d


class Trainer:
    """One rank's training loop (see the module docstring). Every rank of the job builds one."""

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
        self.corpus, self.sampler = corpus, sampler
        max_len = sampler.max_len if sampler.max_len is not None else int(sampler.piece_lengths().max())
        check_job_pool(settings.pool, self.world, settings.model, settings.cost, max_len)
        self.dtype = DTYPES[settings.dtype]
        self.layout = ShardLayout(settings.model, self.world)
        self.optimizer = ShardedOptimizer(
            self.layout, self.rank, settings.optim.adamw, self.env.device, bucket_bytes=settings.exchange_bucket_bytes,
            scaled_grad=self.dtype != torch.float32,  # 2-byte reduced gradients under bf16 (optimizer.OwnedGradient)
        )
        self.optimizer.init(settings.seed)
        # Plans travel on a CPU group: NCCL cannot broadcast host memory.
        timeout = first_step_timeout(settings.timeout_s)
        self.control = dist.new_group(backend="gloo", timeout=timeout) if self.env.backend != "gloo" else None
        self.deployments = RankPool(
            settings.model,
            settings.pool,
            self.optimizer,
            self.dtype,
            self.env.device,
            settings.sequence_parallel,
            settings.cost.recompute,  # activation recompute: the cost model's set is the one definition
            timeout,
        )
        self._timeouts_settled = False
        self.memory = StepMemory(self.env.device, settings.memory_every, settings.memory_budget_bytes)
        self.planner = PhasedPlanner(settings.cost, self.world, settings.pool) if self.rank == 0 else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planner") if self.rank == 0 else None
        self.step_index = 0
        self._pending: tuple[GlobalBatch, Future | None] | None = None
        self.recent: deque[tuple[GlobalBatch, Schedule]] = deque(maxlen=settings.compare_steps)
        # The last step's own figures on this rank (the metrics carry the largest over ranks); None before it.
        self.last_exchange: Exchange | None = None
        self.last_memory: MemoryFigures | None = None
        self.last_batch: GlobalBatch | None = None

    # -- plans ---------------------------------------------------------------------------
    def _draw(self) -> None:
        """Draw the next batch (every rank) and start planning it in the background (rank 0)."""
        batch = self.sampler.next_batch()
        future = None
        if self.planner is not None:
            future = self._executor.submit(self.planner.schedule, batch.lengths, self.step_index)
        self._pending = (batch, future)

    def _next_plan(self) -> tuple[GlobalBatch, Schedule, float]:
        if self._pending is None:
            self._draw()
        batch, future = self._pending
        self._pending = None
        waited = time.perf_counter()
        payload = None
        if future is not None:
            try:
                payload = encode_schedule(future.result(), self.settings.pool)
            except HydraulisError as exc:
                self.broadcast(None)
                raise HydraulisError(f"planning step {self.step_index}: {exc}") from None
        waited = time.perf_counter() - waited
        data = self.broadcast(payload)
        if data is None:
            raise HydraulisError(f"rank 0 could not plan step {self.step_index}")
        return batch, decode_schedule(data, self.step_index, batch.lengths, self.settings.pool), waited

    def broadcast(self, payload: np.ndarray | None) -> np.ndarray | None:
        """Rank 0's payload on every rank: its length first (-1: rank 0 failed), then the values."""
        if self.world == 1:
            return payload
        size = torch.tensor([-1 if payload is None else len(payload)], dtype=torch.int64)
        dist.broadcast(size, 0, group=self.control)
        if int(size) < 0:
            return None
        data = torch.from_numpy(payload) if payload is not None else torch.empty(int(size), dtype=torch.int64)
        dist.broadcast(data, 0, group=self.control)
        return data.numpy()

    # -- iterations -------------------------------------------------------------------------
    def step(self) -> StepMetrics:
        """Plan (already in flight), run and report one iteration; the next batch's planning starts at once."""
        batch, schedule, waited = self._next_plan()
        self._draw()  # plan i + 1 while iteration i computes
        self.recent.append((batch, schedule))
        self.last_batch = batch  # what the step trained (training/loop.py counts a mixture's sources in it)
        return self.run_schedule(batch, schedule, planning_unhidden_s=waited)

    def micro_batches(
        self, batch: GlobalBatch, plan: IterationPlan, part: RankDeployment, corpus: Corpus | None = None
    ) -> list[MicroBatchInput]:
        """This rank's replica's micro-batches (its CP rank's share of each): only its documents are read, from
        the training corpus or `corpus` (evaluation's)."""
        pad = part.groups.config.tp if part.groups.tp.sequence_parallel else 1
        cp = part.groups.cp
        corpus = self.corpus if corpus is None else corpus
        out = []
        for mb in plan.replicas[part.replica].micro_batches:
            docs, masks = [], []
            for i in mb:
                start, end = int(batch.starts[i]), int(batch.starts[i]) + int(batch.lengths[i])
                docs.append(torch.from_numpy(np.asarray(corpus[int(batch.docs[i])][start:end], dtype=np.int64)))
                mask = corpus.target_mask(int(batch.docs[i]))  # SFT corpora: which tokens are targets
                masks.append(None if mask is None else torch.from_numpy(np.array(mask[start:end], dtype=np.uint8)))
            out.append(concatenate_cp_shard(docs, cp.size, cp.rank, pad_to_multiple=pad, masks=masks))
        return out

    def batch_targets(self, batch: GlobalBatch, corpus: Corpus | None = None) -> int:
        """The loss's denominator: targets of the whole global batch (SFT: the masked ones), at least 1."""
        n = (self.corpus if corpus is None else corpus).piece_targets(batch.docs, batch.starts, batch.lengths)
        return max(int(n), 1)

    def run_iteration(self, batch: GlobalBatch, plan: IterationPlan, planning_unhidden_s: float = 0.0) -> StepMetrics:
        """Execute one plan on one batch (every rank, the same plan); returns the metrics (meaningful on rank 0)."""
        return self.run_schedule(batch, Schedule.single(plan), planning_unhidden_s)

    def _start_memory(self, indices: Sequence[int], schedule: Schedule) -> list[RankMemory]:
        """This rank's predicted memory in each phase (a later one holds the earlier phases' reduced gradient);
        the meter started if the iteration is due; on CPU every rank then waits for the others.

        Why the wait: a CPU rank that measures takes a census of its live tensors first (90-250 ms on tiny,
        its own decision), and without it rank 0's clock, and every replica waiting on that rank in a
        collective, counted the census as training: the demo's measured steps ran 18% over their prediction,
        the others 5%."""
        s = self.settings
        ranks = [predicted_rank(s.cost.later_phase() if n else s.cost, s.model, self.deployments.parts[k], p,
                                self.world, self.dtype, s.exchange_bucket_bytes)
                 for n, (k, p) in enumerate(zip(indices, schedule.phases, strict=True))]
        self.memory.start(indices[0], self.step_index, max(r.peak for r in ranks))
        if self.env.device.type == "cpu" and self.world > 1:
            dist.barrier(group=self.control)
        return ranks

    def run_schedule(self, batch: GlobalBatch, schedule: Schedule, planning_unhidden_s: float = 0.0) -> StepMetrics:
        """Its phases one after another (runtime/phases.py), then one optimizer step on their summed gradients."""
        s = self.settings
        indices = [s.pool.index(p.deployment) for p in schedule.phases]
        ranks = self._start_memory(indices, schedule)
        start = time.perf_counter()
        targets = self.batch_targets(batch)
        runs = run_phases(self, batch, schedule, targets, [r.reduce_after for r in ranks])
        self.last_exchange = runs[-1].exchange
        norm, extra = self.optimizer.global_norm(extra=loss_part(runs, self.env.device).reshape(1))
        lr = s.optim.lr_at(self.step_index, s.steps)
        values = torch.stack([norm.detach().double().cpu(), extra[0].double().cpu()]).tolist()  # one sync per step
        skipped = not finite(values[1], values[0])  # the same numbers on every rank: they agree
        self.optimizer.step(lr, norm, skip=skipped)
        if self.env.device.type == "cuda":
            torch.cuda.synchronize()
        finished = time.perf_counter()  # the iteration ends here; what follows only reports on it
        memory = self.memory.stop(max(r.exchange.buffer_bytes for r in runs))
        self.last_memory = memory
        for r in runs:
            r.part.clear_grads()
        figures = RankFigures.of(runs, memory).across_ranks(self.control)
        # Each replica's prediction travels with the plan (planner.finalize); only a plan nobody simulated (made by
        # hand: tests, benchmarks) is simulated here, with this trainer's cost model.
        predicted = [p.replica_predicted_s or tuple(simulate(p, s.cost, keep_events=False).replica_times_s)
                     for p in schedule.phases]
        measured = figures.memory_peak > 0  # some rank measured this step's memory
        metrics = StepMetrics(
            step=self.step_index,
            loss=values[1] / targets,
            tokens=batch.num_tokens,
            sequences=len(batch),
            deployment=" | ".join(str(p.deployment) for p in schedule.phases),
            deployment_index=runs[-1].index,
            switched=runs[0].switched,
            iteration_s=finished - start,
            predicted_s=phases_time(schedule.phases, s.cost, schedule.switch_s),
            planning_s=schedule.planning_time_s,
            planning_unhidden_s=planning_unhidden_s,
            switch_s=runs[0].activate_s,
            gather_s=sum(r.gather_s for r in runs),
            reduce_s=sum(r.reduce_s for r in runs),
            lr=lr,
            grad_norm=values[0],
            replica_s=figures.replica_s,
            replica_predicted_s=tuple(float(t) for times in predicted for t in times),
            micro_batches=tuple(len(r.micro_batches) for p in schedule.phases for r in p.replicas),
            epoch=batch.state.epoch,
            position=batch.state.position,
            skipped=skipped,
            memory_peak_bytes=int(figures.memory_peak) if measured else None,
            memory_predicted_bytes=int(figures.memory_predicted),
            exchange_peak_bytes=int(figures.exchange_peak) if measured else None,
            memory_error=figures.memory_error if measured else None,
            exchange_exposed_s=figures.exposed_s,
            exchange_exposed_min_s=figures.exposed_min_s,
            phases=len(runs),
            phase_switch_s=figures.switch_min_s,
            phase_switch_predicted_s=schedule.switch_s * (len(runs) - 1),
            memory_over_budget=s.memory_budget_bytes is not None and figures.memory_peak > s.memory_budget_bytes,
            deployment_indices=tuple(indices),
        )
        self.step_index += 1
        if not self._timeouts_settled:  # the first step is done: every group gets the steady timeout
            settle_timeouts(self.settings.timeout_s, [*built_groups(), self.control])
            self._timeouts_settled = True
        return metrics

    # -- measured comparison ------------------------------------------------------------------
    def compare(self, repeats: int = 3) -> Comparison | None:
        """The recent batches again, as planned and on each homogeneous deployment (runtime/compare.py)."""
        return compare(self, repeats)

    # -- checkpoints (checkpoint.py) ------------------------------------------------------------
    def next_sampler_state(self) -> SamplerState:
        """Where the first batch not yet trained starts (the sampler has already drawn one ahead)."""
        return self._pending[0].state if self._pending is not None else self.sampler.state

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this rank's training: the next step, the sampler's position there, the
        LR schedule's inputs and the optimizer's owned state (its tensors live, not copied)."""
        return {
            "step": self.step_index,
            "sampler": self.next_sampler_state(),
            "schedule": self.settings.lr_schedule_state(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict` (the schedule is this run's settings; the caller compares it)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.restore(state["step"], state["sampler"])

    def restore(self, step_index: int, sampler_state: SamplerState) -> None:
        """Continue at `step_index` with the batch at `sampler_state`: a batch drawn ahead is dropped."""
        if self._pending is not None and self._pending[1] is not None:
            self._pending[1].cancel()  # a plan already running finishes; its result is never read
        self._pending = None
        self.sampler.state = sampler_state
        self.step_index = step_index

    def use_cost(self, cost: CostModel) -> None:
        """Plan (rank 0) and predict the next batches with `cost`: the online refit's model.

        The batch already being planned with the old model is planned again: a refit takes effect at the next
        step, as in a run resumed there (its checkpoint keeps the refit), so both plan the same."""
        self.settings = replace(self.settings, cost=cost)
        if self.planner is not None:
            outlook = self.planner.outlook  # the same record: a plan in flight adds its step to it
            self.planner = PhasedPlanner(cost, self.world, self.settings.pool)
            self.planner.outlook = outlook
            if self._pending is not None and self._pending[1] is not None:
                batch, future = self._pending
                future.cancel()  # if it already runs, it finishes; its result is never read
                self._pending = (batch, self._executor.submit(self.planner.schedule, batch.lengths, self.step_index))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
