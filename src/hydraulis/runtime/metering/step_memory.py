"""One iteration's memory on one rank: measured by torch's allocator, predicted by the cost model's formulas.

Measured (`memory_meter`): what the process held at the iteration's start
(a census of live tensor storages on CPU, `memory_allocated` on CUDA) plus
the allocator's peak above it during the iteration; the exchange's own peak
is the allocator's peak inside gather and reduce on CPU, and on CUDA the
largest send and receive buffers the exchanges report they held (`Exchange.buffer_bytes`,
handed to `StepMemory.stop`). Predicted:
`cost.memory.rank_memory` for the rank's config and stage and its replica's
largest micro-batch under each memory policy. Neither reads the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch

from hydraulis.cost.activations import in_flight
from hydraulis.cost.memory import RankMemory, rank_memory
from hydraulis.cost.model import CostModel
from hydraulis.planner.plan import IterationPlan
from hydraulis.runtime.deployments import RankDeployment
from hydraulis.runtime.metering.memory_meter import PeakMeter, live_tensor_bytes
from hydraulis.runtime.optimizer.exchange_plan import EXCHANGE_WINDOW
from hydraulis.settings import CPU_SAMPLE_EVERY  # CPU iterations are sampled: a trace costs much of a small step
from hydraulis.specs import ModelSpec


@dataclass(frozen=True)
class MemoryFigures:
    """One rank's bytes in one iteration."""

    peak: int
    predicted: int
    exchange_peak: int

    @property
    def error(self) -> float:
        """|measured - predicted| / predicted; 0 for an iteration that was not measured."""
        return abs(self.peak - self.predicted) / self.predicted if self.predicted > 0 and self.peak > 0 else 0.0




class StepMemory:
    """Start before an iteration, stop after its optimizer step.

    On CUDA every iteration is measured. On CPU: the first iteration on each deployment (memory
    depends on it), every `every`-th step and, under a memory budget, every iteration whose predicted
    peak is this rank's highest yet (the ones that could break it); the others report a measured peak
    of 0. The decision is each rank's own: the meter takes no collective.

    `budget` (`[parallel] memory_per_rank`): the bytes a rank may hold; on CUDA the allocator is
    limited to it (`torch.cuda.set_per_process_memory_fraction`, not run here without a GPU). `quiet`: what
    keeps this process's other Python threads from building objects during a CPU census (the plan feed's
    `paused`).
    """

    def __init__(
        self,
        device: torch.device,
        every: int = CPU_SAMPLE_EVERY,
        budget: int | None = None,
        quiet: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.device = device
        self.every = every
        self.budget = budget
        self.quiet = quiet
        self.meter = PeakMeter(device)
        self._base = 0
        self._seen: set[int] = set()
        self._measuring = False
        self._predicted = 0.0
        self._highest = 0.0  # the highest predicted peak measured so far
        if budget is not None and device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)

    def start(self, deployment: int, step: int, predicted: float) -> None:
        """Measure this iteration if it is due; `predicted` is the memory model's peak for it on this rank."""
        riskiest = self.budget is not None and predicted > self._highest
        self._measuring = (
            self.device.type == "cuda" or deployment not in self._seen or step % self.every == 0 or riskiest
        )
        self._seen.add(deployment)
        self._predicted = predicted
        if not self._measuring:
            return
        self._highest = max(self._highest, predicted)
        with self.quiet():
            self._base = live_tensor_bytes(self.device)
        self.meter.start()

    def abandon(self) -> None:
        """The iteration raised: stop measuring, leave nothing on (PeakMeter.abandon)."""
        self.meter.abandon()

    def stop(self, exchange_buffer_bytes: int = 0) -> MemoryFigures:
        """The iteration's figures; `exchange_buffer_bytes`: what its exchanges' buffers held at most (on CUDA the
        exchange's peak, which the allocator cannot tell apart; on CPU the allocator's peak inside them is)."""
        if not self._measuring:
            return MemoryFigures(0, int(self._predicted), 0)
        self.meter.stop()
        exchange = exchange_buffer_bytes if self.device.type == "cuda" else self.meter.window_peak(EXCHANGE_WINDOW)
        return MemoryFigures(self._base + self.meter.peak_bytes, int(self._predicted), int(exchange))


def predicted_rank(
    cost: CostModel,
    model: ModelSpec,
    part: RankDeployment,
    plan: IterationPlan,
    world: int,
    dtype: torch.dtype,
    bucket_bytes: int,
) -> RankMemory:
    """The memory model's figures for this rank in this iteration, for the runtime's own dtype and sequence
    parallelism: its peak, and when its reduce may start (`reduce_after`), for the micro-batches its stage holds
    in flight at once. Per memory policy among its replica's micro-batches (plan.policy), the largest under it
    with the fullest window of those in flight, the others' tokens counted at what they keep per token under
    theirs; the highest peak of those."""
    groups = part.groups
    lengths = np.asarray(plan.lengths)
    micro_batches = plan.replicas[part.replica].micro_batches
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    config = groups.config
    memory = dataclasses.replace(cost.memory, sequence_parallel=groups.tp.sequence_parallel)
    policies = [cost.policy_run(config, plan.policy(part.replica, m)) for m in range(len(micro_batches))]
    plain = cost.policies(config)[0]
    sizes = [int(lengths[list(mb)].sum()) for mb in micro_batches]
    k = in_flight(config, groups.stage, len(sizes))
    kept = {p: memory.bytes_per_token(config, model, p, 1, dtype_bytes) for p in {*policies, plain}}
    ranks = []
    for policy in set(policies) or {plain}:  # an idle replica's: its plain one
        tokens = max((t for t, p in zip(sizes, policies, strict=True) if p == policy), default=0)
        # 1F1B holds consecutive micro-batches in flight (runtime/pipeline/): the fullest window's tokens.
        same = [t * kept[p] / kept[policy] for t, p in zip(sizes, policies, strict=True)]
        window = max((sum(same[i : i + k]) for i in range(max(1, len(same) - k + 1))), default=0)
        ranks.append(rank_memory(
            memory, model, config, stage=groups.stage, num_gpus=world, tokens=tokens, dtype_bytes=dtype_bytes,
            bucket_bytes=bucket_bytes, recompute=policy, micro_batches=len(micro_batches),
            contributors=sum(r.config.cp for r in plan.deployment.replicas), window=max(tokens, int(window)),
        ))
    return max(ranks, key=lambda r: r.peak)
