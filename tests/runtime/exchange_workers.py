"""Training variants on every rank (bucket sizes, dtypes): one run each on the same plans, the exchange measured."""

from __future__ import annotations

import dataclasses

import torch
from train_workers import corpus, sampler

from hydraulis.planner.plan import IterationPlan
from hydraulis.runtime import groups
from hydraulis.runtime.launch import init_distributed
from hydraulis.runtime.memory_meter import PeakMeter
from hydraulis.runtime.trainer import Trainer, TrainSettings


def timeout_s(group) -> float:
    """The timeout a process group's gloo backend now has."""
    group = group or torch.distributed.distributed_c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def metered(opt, name: str, peaks: list[int]) -> None:
    """Wrap optimizer.<name> so that every call's allocation peak (torch's allocator) is recorded."""
    inner = getattr(opt, name)

    def call(*args, **kwargs):
        with PeakMeter() as meter:
            inner(*args, **kwargs)
        peaks.append(meter.peak_bytes)

    setattr(opt, name, call)


def train_variants(
    rank: int, world: int, s: TrainSettings, plans: list[IterationPlan], variants: list[dict]
) -> list[dict]:
    """The same switching steps once per variant of the settings: final owned master, losses, exchange peaks."""
    env = init_distributed("cpu")
    out = []
    for changes in variants:
        docs = corpus(s.model.vocab)
        smp = sampler(docs)
        trainer = Trainer(dataclasses.replace(s, **changes), docs, smp, env)
        peaks: list[int] = []
        metered(trainer.optimizer, "gather", peaks)
        metered(trainer.optimizer, "reduce", peaks)
        metrics = [trainer.run_iteration(smp.next_batch(), plan) for plan in plans]
        trainer.close()
        plan_rounds = {str(d): len(trainer.optimizer.plan(d, s.sequence_parallel).rounds) for d in s.pool}
        out.append({
            "master": trainer.optimizer.master.clone(),
            "losses": [m.loss for m in metrics],
            "grad_norms": [m.grad_norm for m in metrics],
            "measured_peak": max(peaks),
            "buffer_peak": trainer.optimizer.exchange_peak_bytes,
            "rounds": plan_rounds,
            "groups": sorted(k for k, g in groups._GROUPS.items() if g is not None),
            "timeouts": sorted({timeout_s(g) for g in [None, *groups.built_groups()]}),
        })
    torch.distributed.barrier()
    return out
