"""The bucketed exchange on every rank: one training run per bucket size, the exchange's peak measured."""

from __future__ import annotations

import dataclasses

import torch
from train_workers import corpus, sampler

from hydraulis.planner.plan import IterationPlan
from hydraulis.runtime.launch import init_distributed
from hydraulis.runtime.memory_meter import PeakMeter
from hydraulis.runtime.trainer import Trainer, TrainSettings


def metered(opt, name: str, peaks: list[int]) -> None:
    """Wrap optimizer.<name> so that every call's allocation peak (torch's allocator) is recorded."""
    inner = getattr(opt, name)

    def call(*args, **kwargs):
        with PeakMeter() as meter:
            inner(*args, **kwargs)
        peaks.append(meter.peak_bytes)

    setattr(opt, name, call)


def train_buckets(rank: int, world: int, s: TrainSettings, plans: list[IterationPlan], buckets: list[int]) -> dict:
    """The same switching steps once per bucket size: final owned master, losses and exchange peaks."""
    env = init_distributed("cpu")
    out = {}
    for bucket in buckets:
        docs = corpus(s.model.vocab)
        smp = sampler(docs)
        trainer = Trainer(dataclasses.replace(s, exchange_bucket_bytes=bucket), docs, smp, env)
        peaks: list[int] = []
        metered(trainer.optimizer, "gather", peaks)
        metered(trainer.optimizer, "reduce", peaks)
        metrics = [trainer.run_iteration(smp.next_batch(), plan) for plan in plans]
        trainer.close()
        plan_rounds = {str(d): len(trainer.optimizer.plan(d, s.sequence_parallel).rounds) for d in s.pool}
        out[bucket] = {
            "master": trainer.optimizer.master.clone(),
            "losses": [m.loss for m in metrics],
            "grad_norms": [m.grad_norm for m in metrics],
            "measured_peak": max(peaks),
            "buffer_peak": trainer.optimizer.exchange_peak_bytes,
            "rounds": plan_rounds,
        }
    torch.distributed.barrier()
    return out
