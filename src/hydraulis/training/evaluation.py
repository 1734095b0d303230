"""`[eval]`: the held-out data, its batches and their plans, fixed before any rank starts.

The held-out documents are a share of the training corpus that the training
sampler never draws (`sampler.held_out`: by the data seed alone), or an eval
corpus of their own. They are read in corpus order, split by `[data] max_len`
as training splits them, into global batches of `[data] tokens_per_batch`
until `[eval] tokens`: the same batches at every evaluation and after every
resume. Each batch is planned here, once, by the run's planner on the run's
pool with the forward-only cost model (`CostModel.forward_only`), so every
evaluation runs the same plans; the ranks run them forward only
(runtime/evaluation.py). The loss is the mean over the batches' target tokens
(SFT: the masked ones), as training counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.data.indexed import IndexedCorpus, corpus_sampler
from hydraulis.data.sampler import GlobalBatch, TokenBudgetSampler, held_out
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment
from hydraulis.planner.phases import PhasedPlanner
from hydraulis.planner.plan import encode_schedule
from hydraulis.training.job_config import DataChoice, EvalChoice


@dataclass(frozen=True)
class EvalSet:
    """The evaluation of a run: where its documents are, its batches and each batch's plan (encoded)."""

    corpus_path: str
    batches: tuple[GlobalBatch, ...]
    plans: tuple[np.ndarray, ...]  # plan.encode_schedule of each batch, on the run's pool
    every: int  # evaluate after every this many steps (0: only at the end of the schedule)

    @property
    def tokens(self) -> int:
        return sum(b.num_tokens for b in self.batches)

    def due(self, step: int, last: int) -> bool:
        """Whether to evaluate after `step` optimizer steps of a schedule of `last`."""
        return step == last or (self.every > 0 and step % self.every == 0)


def training_documents(holdout: float, seed: int, corpus: IndexedCorpus) -> np.ndarray | None:
    """The documents the training sampler draws: all of them (None), or those `[eval] holdout` leaves it (by the
    `[data] seed`)."""
    if holdout <= 0:
        return None
    return held_out(len(corpus), holdout, seed)[0]


def run_sampler(data: DataChoice, holdout: float, corpus: IndexedCorpus) -> TokenBudgetSampler:
    """The training sampler of a run, built once before the ranks start (job.prepare); every rank gets a copy."""
    return corpus_sampler(
        corpus, tokens_per_batch=data.tokens_per_batch, max_len=data.max_len, seed=data.seed, policy=data.overlong,
        documents=training_documents(holdout, data.seed, corpus),
        mixture=corpus.mixture,  # a MixedCorpus (training/mixture.py): its sources by their weights
    )


def eval_batches(
    data: DataChoice, evaluation: EvalChoice, corpus: IndexedCorpus, held: bool
) -> tuple[GlobalBatch, ...]:
    """The held-out documents (`held`: the holdout share of `corpus`, else all of it) in corpus order, in
    batches of the run's token budget, until `[eval] tokens` (at least one batch)."""
    docs = held_out(len(corpus), evaluation.holdout, data.seed)[1] if held else None
    sampler = corpus_sampler(corpus, tokens_per_batch=data.tokens_per_batch, max_len=data.max_len, seed=data.seed,
                             policy=data.overlong, documents=docs, shuffle=False, cross_epochs=False)
    batches: list[GlobalBatch] = []
    tokens = 0
    while not batches or sampler.state.epoch == 0:
        batch = sampler.next_batch()
        if batches and tokens + batch.num_tokens > evaluation.tokens:
            break
        batches.append(batch)
        tokens += batch.num_tokens
    return tuple(batches)


def eval_set(
    data: DataChoice, evaluation: EvalChoice, *, corpus: IndexedCorpus, held: bool, cost: CostModel, world: int,
    pool: tuple[Deployment, ...],
) -> EvalSet:
    """The run's evaluation: its batches, each planned forward only on the run's pool."""
    batches = eval_batches(data, evaluation, corpus, held)
    if not sum(corpus.piece_targets(b.docs, b.starts, b.lengths) for b in batches):
        where = f"the held-out share ([eval] holdout = {evaluation.holdout}) of {corpus.path}" if held else corpus.path
        raise HydraulisError(f"[eval]: {where} holds no target tokens in its {len(batches)} batch(es) (every token "
                             "masked out, or documents of one token): its loss would be undefined; evaluate on "
                             "data with targets, or leave [eval] out")
    planner = PhasedPlanner(cost.forward_only(), world, pool)
    plans = tuple(encode_schedule(planner.schedule(b.lengths), pool) for b in batches)
    return EvalSet(str(corpus.path), batches, plans, evaluation.every)
