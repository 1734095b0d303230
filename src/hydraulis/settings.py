"""What a trainer runs, resolved once before any rank starts: frozen records, no torch.

`training/job.py`'s `prepare` turns the validated config into a tree of
settings (training/settings.py's `RunSettings`); the part every rank's
`Trainer` reads is this module's `TrainerSettings`: the model, how the pool
runs (`ParallelSettings`), the optimizer (optim.py) and `[train]`
(`TrainSettings`). Every default and every value derived from the job's cost
model is filled in here, once; nothing rewrites a record after it is made.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hydraulis.cost.model import CostModel
from hydraulis.limits import DEFAULT_TIMEOUT_S
from hydraulis.optim import OptimSettings
from hydraulis.parallel import Deployment
from hydraulis.specs import ModelSpec

# On CPU a step's memory is measured by a trace of every allocation and a census of live tensors: it costs a large
# share of a small model's step, so CPU steps are sampled (runtime/metering/step_memory.py; CUDA's counters are free).
CPU_SAMPLE_EVERY = 50

DEFAULT_KEEP = 2  # checkpoints a run keeps: the config's [train] keep_checkpoints default (config.TrainSection)


@dataclass(frozen=True)
class ParallelSettings:
    """How the pool runs on the ranks. The cost model plans and predicts what runs: its exchange bucket, memory
    budget, sequence parallelism and recompute set are the runtime's, and `overlap` is in it (`of`)."""

    pool: tuple[Deployment, ...]
    cost: CostModel
    sequence_parallel: bool
    exchange_bucket_bytes: int  # the most bytes one exchange buffer holds ([parallel] exchange_bucket_mb)
    memory_budget_bytes: int | None  # each rank's measured peak is checked against it ([parallel] memory_per_rank)
    overlap: bool = True  # gather and reduce beside compute (runtime/optimizer/exchange.py)
    memory_per_rank: str | int | None = None  # the budget as the config wrote it (messages name it)
    zero_bubble: bool = False  # the planner defers weight gradients into pipeline gaps ([parallel] zero_bubble)

    @classmethod
    def of(
        cls, pool: tuple[Deployment, ...], cost: CostModel, overlap: bool = True, *,
        sequence_parallel: bool | None = None, exchange_bucket_bytes: int | None = None,
        memory_budget_bytes: int | None = None, memory_per_rank: str | int | None = None, zero_bubble: bool = False,
    ) -> ParallelSettings:
        """The pool on `cost` (made the job's: training/job_cost.py), each value the cost model's unless given
        (tests and benchmarks give some); the cost model's replica times as the exchange runs (`overlap`)."""
        memory = cost.memory
        bucket = memory.exchange_bucket_bytes if exchange_bucket_bytes is None else exchange_bucket_bytes
        return cls(
            pool=tuple(pool),
            cost=cost.with_overlap(overlap),
            sequence_parallel=memory.sequence_parallel if sequence_parallel is None else sequence_parallel,
            exchange_bucket_bytes=bucket,
            memory_budget_bytes=memory.budget_bytes if memory_budget_bytes is None else memory_budget_bytes,
            overlap=overlap,
            memory_per_rank=memory_per_rank,
            zero_bubble=zero_bubble,
        )

    def with_cost(self, cost: CostModel) -> ParallelSettings:
        """Planning and predicting with `cost` (the online refit's), as the exchange runs."""
        return replace(self, cost=cost.with_overlap(self.overlap))


@dataclass(frozen=True)
class TrainSettings:
    """`[train]`, resolved: what the trainer runs with, and what the run around it (training/run.py) reads."""

    steps: int  # the LR schedule's length (--steps, else [train] steps)
    seed: int = 1  # [data] seed: the initial weights and the batches
    dtype: str = "fp32"
    reduce_dtype: str = "fp32"  # what gradients travel in to their owners (summed in fp32 there)
    timeout_s: float = DEFAULT_TIMEOUT_S  # process-group timeout after the first step (parallelism/timeouts.py)
    compare_steps: int = 0  # the last batches kept for `Trainer.compare`
    compare_repeats: int = 3
    memory_every: int = CPU_SAMPLE_EVERY  # on CPU, measure memory every this many steps (step_memory.py)
    device: str = "auto"
    log_every: int = 1
    checkpoint_every: int = 0
    keep_checkpoints: int = DEFAULT_KEEP
    max_bad_steps: int = 3
    init_from: str | None = None  # [model] init_from: the Hugging Face directory the weights start from


@dataclass(frozen=True)
class TrainerSettings:
    """Every rank's trainer: the model, its pool, the optimizer and `[train]`."""

    model: ModelSpec
    parallel: ParallelSettings
    optim: OptimSettings
    train: TrainSettings

    def lr_schedule_state(self) -> dict[str, Any]:
        """What the LR at each step depends on (optim.OptimSettings.lr_schedule_state)."""
        return self.optim.lr_schedule_state(self.train.steps)

    def with_cost(self, cost: CostModel) -> TrainerSettings:
        return replace(self, parallel=self.parallel.with_cost(cost))
