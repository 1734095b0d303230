"""Evaluation on the ranks: the held-out batches forward only, each on the deployments its plan chose.

Every rank runs `evaluate` after the same step. Per batch and phase: the
plan's deployment is activated and its compute shard gathered from the
optimizer's owners (nothing is reduced, nothing of the optimizer changes),
then this rank's replica runs its micro-batches forward only
(pipeline.forward_step). The last stages' sums of token losses (TP rank 0,
every CP rank its share) are summed over the job in one all-reduce and
divided by the batches' target tokens. The plans were made before the ranks
started (training/evaluation.py's EvalSet), so every evaluation runs the same ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from hydraulis.data.sampler import GlobalBatch
from hydraulis.planner.plan import decode_schedule
from hydraulis.runtime.iteration import sub_batch
from hydraulis.runtime.parallelism.batch import Corpus
from hydraulis.runtime.pipeline.step import forward_step
from hydraulis.runtime.trainer import Trainer


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: the mean loss over the held-out target tokens, after `step` optimizer steps."""

    step: int
    loss: float
    tokens: int
    targets: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def to_dict(self) -> dict[str, float | int]:
        return {"step": self.step, "loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens,
                "targets": self.targets}  # fmt: skip


def evaluate(
    trainer: Trainer, batches: Sequence[GlobalBatch], plans: Sequence[np.ndarray], corpus: Corpus
) -> EvalResult:
    """The held-out loss of the model as the optimizer's owners hold it now (every rank calls it): `batches` of
    `corpus`, each run on its plan (plan.encode_schedule on the run's pool)."""
    pool = trainer.settings.parallel.pool
    total = torch.zeros((), dtype=torch.float64)
    targets = 0
    for batch, data in zip(batches, plans, strict=True):
        schedule = decode_schedule(data, trainer.step_index, batch.lengths, pool)
        for plan, positions in zip(schedule.phases, schedule.indices, strict=True):
            part, _ = trainer.deployments.activate(trainer.deployments.index(plan.deployment))
            trainer.deployments.gather(part)
            part_batch = batch if len(schedule.phases) == 1 else sub_batch(batch, positions)
            micro_batches = trainer.source.micro_batches(part_batch, plan, part.replica, part.groups,
                                                         cost=trainer.settings.parallel.cost, corpus=corpus)
            loss = forward_step(part.model, part.groups, micro_batches)
            if loss is not None and part.groups.tp.rank == 0:
                total += loss.double().cpu()
        targets += corpus.piece_targets(batch.docs, batch.starts, batch.lengths)  # eval_set: not all batches 0
    if trainer.world > 1:
        dist.all_reduce(total, group=trainer.control)
    return EvalResult(trainer.step_index, float(total) / max(targets, 1), sum(b.num_tokens for b in batches), targets)
