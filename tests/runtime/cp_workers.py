"""What the context-parallel tests run on every gloo rank (importable by spawned children; no transformers)."""

from __future__ import annotations

import dataclasses
import datetime
import json

import numpy as np
import torch
from train_workers import cpu_settings, weight_slots

from hydraulis.cost.policies import MemoryPolicy
from hydraulis.data.sampler import TokenBudgetSampler
from hydraulis.optim import AdamWSettings, OptimSettings
from hydraulis.parallel import ParallelConfig, Replica
from hydraulis.runtime import StageModel, build_replica_groups, count_targets
from hydraulis.runtime.parallelism.batch import TokenDocuments, concatenate_cp_shard
from hydraulis.runtime.parallelism.launch import init_distributed
from hydraulis.runtime.pipeline.step import train_step
from hydraulis.runtime.trainer import Trainer
from hydraulis.settings import TrainerSettings
from hydraulis.specs import MODELS, ModelSpec

TIMEOUT = datetime.timedelta(seconds=60)

# scenario -> (replicas on the 4 ranks, sequence parallel, recompute); every replica trains every micro-batch.
# Rank lists are permuted in some, so CP-rank order differs from torch's sorted group order.
SCENARIOS = {
    "cp2": ((Replica(ParallelConfig(1, 1, 2), (0, 1)), Replica(ParallelConfig(1, 1, 2), (3, 2))), False, False),
    "cp4": ((Replica(ParallelConfig(1, 1, 4), (2, 0, 3, 1)),), False, False),
    "tp2cp2": ((Replica(ParallelConfig(2, 1, 2), (0, 1, 2, 3)),), False, False),
    "tp2cp2-sp": ((Replica(ParallelConfig(2, 1, 2), (3, 1, 0, 2)),), True, False),
    "cp2pp2": ((Replica(ParallelConfig(1, 2, 2), (0, 1, 2, 3)),), False, False),
    # activation recompute reruns the K/V all-gather in backward, on every CP rank alike
    "cp2pp2-recompute": ((Replica(ParallelConfig(1, 2, 2), (1, 3, 0, 2)),), False, True),
    # interleaved 1F1B, two model chunks per rank: the p2p lanes of each CP rank wrap from the last stage to the first
    "cp2pp2vp2": ((Replica(ParallelConfig(1, 2, 2, vp=2), (2, 0, 3, 1)),), False, False),
    # the same, each backward's weight gradients deferred to the stage's end (zero-bubble W's, weight_grad.py)
    "cp2pp2vp2-zb": ((Replica(ParallelConfig(1, 2, 2, vp=2), (2, 0, 3, 1)),), False, False),
}
DEFERRED = {"cp2pp2vp2-zb": "end"}  # scenario -> train_workers.weight_slots's pattern


def run_scenarios(
    rank: int, world: int, spec: ModelSpec, state: dict, docs: list, micro_batches, names=tuple(SCENARIOS)
) -> dict:
    """One step of each named scenario: this rank's loss share and its stage's full gradients (summed over CP)."""
    out = {}
    total = count_targets([len(d) for d in docs])
    for scenario in names:
        replicas, sp, recompute = SCENARIOS[scenario]
        groups = build_replica_groups(replicas, sp, TIMEOUT)
        config = groups.config
        model = StageModel(spec, groups.tp, groups.stage, config.pp, cp=groups.cp, vp=config.vp)
        model.load_full_state_dict(state)
        pad = config.tp if sp else 1
        packed = [dataclasses.replace(concatenate_cp_shard([docs[i] for i in mb], config.cp, groups.cp.rank, pad),
                                      policy=int(MemoryPolicy.FULL if recompute else MemoryPolicy.NONE))
                  for mb in micro_batches]
        pattern = DEFERRED.get(scenario)
        slots = () if pattern is None else weight_slots(config.pp, config.vp, len(packed), groups.stage, pattern)
        result = train_step(model, groups, packed, total, deferred=slots)
        out[scenario] = {
            "replica": replicas.index(next(r for r in replicas if rank in r.devices)),
            "loss": result.loss if groups.tp.rank == 0 else None,  # one share per CP rank of the last stage
            "grads": model.full_grads(),
            "stage": groups.stage,
            "cp_rank": groups.cp.rank,
            "tokens": [b.num_tokens for b in packed],
        }
        torch.distributed.barrier()
    return out


# ------------------------------------------------------------ training: a pool with cp4 and cp2 deployments

CP_TRAIN_STEPS = 4
LONG_DOC = 512  # 4x the tp1pp1 lone cap of the profile below: only the cp4 replica can hold it


def cp_train_cost():
    """tiny's measured CPU profile with cp rows and just too little memory for 256 tokens on tp1pp1, even as a lone
    micro-batch: its lone cap is 128, and cp4's rank holds ceil(512 / 4) + 8 tokens plus the kept K/V and the
    loss head's (cap 512 or more), while cp2's lone micro-batch holds less than 512."""
    import dataclasses
    from importlib import resources

    from hydraulis.cost.profiled import ProfiledCostModel

    data = json.loads(resources.files("hydraulis.cost.profiles").joinpath("tiny-cpu-measured.json").read_text())
    base = ProfiledCostModel.from_dict(data)
    mem, g = base.memory, ParallelConfig(1, 1)
    low, high = 0, 1 << 40  # the cap grows with the memory: the least memory whose lone cap is 256 tokens
    while high - low > 1:
        mid = (low + high) // 2
        fits = dataclasses.replace(mem, memory_bytes=mid).cap(g, base.model, 4, micro_batches=1) >= 256
        low, high = (low, mid) if fits else (mid, high)
    data["device"]["memory_bytes"] = low
    row = next(r for r in data["time_ms"] if (r["tp"], r["pp"]) == (1, 1))
    data["time_ms"] += [{**row, "cp": 4}, {**row, "cp": 2}]
    return ProfiledCostModel.from_dict(data)


def cp_train_corpus(vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    lengths = [LONG_DOC, *rng.integers(4, 60, size=20).tolist()]
    return [rng.integers(0, vocab, size=int(n)).astype(np.uint16) for n in lengths]


def cp_train_sampler(docs: list[np.ndarray]) -> TokenBudgetSampler:
    return TokenBudgetSampler([len(d) for d in docs], tokens_per_batch=800, max_len=LONG_DOC, seed=7)


def cp_train_settings() -> TrainerSettings:
    # cp4 alone holds the long document; batches without it may take cp2 next to two tp1pp1 replicas
    pool = ("1x(tp1,pp1,cp4)", "1x(tp1,pp1,cp2) + 2x(tp1,pp1)")
    optim = OptimSettings(lr=1e-3, warmup=1, schedule="cosine", adamw=AdamWSettings(eps=1e-6, grad_clip=0.5))
    return cpu_settings(4, pool, optim, CP_TRAIN_STEPS, cost=cp_train_cost(), seed=3)


def train_cp(rank: int, world: int, s: TrainerSettings) -> dict:
    """The trainer on 4 ranks, planning every step itself; rank 0's metrics and every owner's master range."""
    env = init_distributed("cpu")
    docs = cp_train_corpus(s.model.vocab)
    trainer = Trainer(settings=s, corpus=TokenDocuments(docs), sampler=cp_train_sampler(docs), env=env)
    metrics = [trainer.step().to_dict() for _ in range(s.train.steps)]
    trainer.close()
    return {"metrics": metrics, "master": trainer.optimizer.master.clone()}


def measure_configs(rank: int, world: int, configs, settings) -> dict:
    """`runtime.metering.profiler.measure` on this rank (the profiler's per-rank work, without its up-front checks)."""
    from hydraulis.runtime.metering.profiler import measure

    return measure(MODELS["tiny"], configs, settings, init_distributed("cpu"))
