"""What the context-parallel tests run on every gloo rank (importable by spawned children; no transformers)."""

from __future__ import annotations

import datetime

import torch

from hydraulis.parallel import ParallelConfig, Replica
from hydraulis.runtime import StageModel, build_replica_groups, count_targets
from hydraulis.runtime.batch import pack_cp_shard
from hydraulis.runtime.pipeline import train_step
from hydraulis.specs import ModelSpec

TIMEOUT = datetime.timedelta(seconds=60)

# scenario -> (replicas on the 4 ranks, sequence parallel); every replica trains every micro-batch.
# Rank lists are permuted in some, so CP-rank order differs from torch's sorted group order.
SCENARIOS = {
    "cp2": ((Replica(ParallelConfig(1, 1, 2), (0, 1)), Replica(ParallelConfig(1, 1, 2), (3, 2))), False),
    "cp4": ((Replica(ParallelConfig(1, 1, 4), (2, 0, 3, 1)),), False),
    "tp2cp2": ((Replica(ParallelConfig(2, 1, 2), (0, 1, 2, 3)),), False),
    "tp2cp2-sp": ((Replica(ParallelConfig(2, 1, 2), (3, 1, 0, 2)),), True),
    "cp2pp2": ((Replica(ParallelConfig(1, 2, 2), (0, 1, 2, 3)),), False),
}


def run_scenarios(rank: int, world: int, spec: ModelSpec, state: dict, docs: list, micro_batches) -> dict:
    """One step of every scenario: this rank's loss share and its stage's full gradients (summed over CP)."""
    out = {}
    total = count_targets([len(d) for d in docs])
    for scenario, (replicas, sp) in SCENARIOS.items():
        groups = build_replica_groups(replicas, sp, TIMEOUT)
        config = groups.config
        model = StageModel(spec, groups.tp, groups.stage, config.pp, cp=groups.cp)
        model.load_full_state_dict(state)
        pad = config.tp if sp else 1
        packed = [pack_cp_shard([docs[i] for i in mb], config.cp, groups.cp.rank, pad) for mb in micro_batches]
        result = train_step(model, groups, packed, total)
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
