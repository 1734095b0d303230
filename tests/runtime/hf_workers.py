"""What the HF-oracle test runs on every gloo rank (importable by spawned children; no transformers here).

The parent builds the HF model, maps its weights to ours and sends them
with the documents; each rank trains one step of its replica and sends back
the loss and its stage's full gradients, which the parent compares with HF's.
"""

from __future__ import annotations

import datetime

import torch

from hydraulis.parallel import ParallelConfig, Replica
from hydraulis.runtime import StageModel, build_replica_groups, concatenate_documents, count_targets, train_step
from hydraulis.specs import ModelSpec

TIMEOUT = datetime.timedelta(seconds=60)

# scenario -> (tp, pp, sequence parallel); each is one replica on all 4 ranks
SCENARIOS = {
    "tp4-gqa": (4, 1, False),  # kv_heads 2 < tp 4: each KV head replicated on 2 ranks
    "tp4-gqa-sp": (4, 1, True),
    "tp2pp2-mqa": (2, 2, False),  # kv_heads 1 < tp 2, through the pipeline
    "tp4-qwen2-padded": (4, 1, False),  # q/k/v biases with KV heads replicated; vocab 509 padded to 512
    "tp2pp2-qwen2-tied": (2, 2, False),  # the head on stage 1 tied to the embedding on stage 0
    "tp4-qwen3-sp": (4, 1, True),  # q/k norms over a rank's heads, sequence parallel
    "tp2pp2-llama3": (2, 2, True),
}


def run_scenarios(rank: int, world: int, cases: dict[str, tuple[ModelSpec, dict, list, tuple]]) -> dict:
    """cases: scenario -> (spec, our full state dict, documents, micro-batches as document indices)."""
    out = {}
    for scenario, (spec, state, docs, micro_batches) in cases.items():
        tp, pp, sp = SCENARIOS[scenario]
        groups = build_replica_groups([Replica(ParallelConfig(tp, pp), tuple(range(world)))], sp, TIMEOUT)
        model = StageModel(spec, groups.tp, groups.stage, pp)
        model.load_full_state_dict(state)
        packed = [concatenate_documents([docs[i] for i in mb], pad_to_multiple=tp) for mb in micro_batches]
        result = train_step(model, groups, packed, count_targets([len(d) for d in docs]))
        out[scenario] = {
            "loss": result.loss,
            "loss_sum": result.loss_sum,
            "grads": model.full_grads(),
            "stage": groups.stage,
        }
        torch.distributed.barrier()
    return out
