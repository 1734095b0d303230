"""Functions the multi-process tests run on every rank (importable by spawned children)."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from train_workers import weight_slots

from hydraulis.parallel import ParallelConfig, Replica
from hydraulis.runtime import (
    IGNORE_INDEX,
    StageModel,
    build_replica_groups,
    concatenate_documents,
    count_targets,
    train_step,
)
from hydraulis.runtime.optimizer.layout import reset_parameters
from hydraulis.runtime.pipeline.step import forward_step
from hydraulis.specs import MODELS

SEED = 1234
# Ten documents of different lengths; micro-batches of different token counts, several documents each.
LENGTHS = (17, 5, 31, 9, 12, 3, 26, 8, 14, 21)
MICRO_BATCHES = ((0, 1, 5), (2, 3), (4, 6, 7), (8, 9))


def documents(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, vocab, (s,), generator=g) for s in LENGTHS]


def reference(model_name: str, doc_ids: tuple[int, ...]) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, one document at a time, F.cross_entropy: loss share and gradients of these documents."""
    spec = MODELS[model_name] if model_name in MODELS else _custom(model_name)
    model = StageModel(spec)
    reset_parameters(model, SEED)
    docs = documents(spec.vocab)
    total = count_targets(LENGTHS)
    loss = torch.zeros(())
    for i in doc_ids:
        batch = concatenate_documents([docs[i]])
        logits = model(batch.tokens, batch)
        loss = loss + F.cross_entropy(logits, batch.targets, ignore_index=IGNORE_INDEX, reduction="sum")
    (loss / total).backward()
    return float(loss.detach() / total), {n: p.grad.clone() for n, p in model.named_parameters()}


def _custom(name: str):
    # "tiny-mqa": one KV head, so tp=2 replicates it.
    assert name == "tiny-mqa"
    return replace(MODELS["tiny"], name="tiny-mqa", kv_heads=1)


def run_replica(
    model_name: str,
    config: ParallelConfig,
    ranks: tuple[int, ...],
    micro_batches,
    sequence_parallel: bool,
    calls: int = 1,
    pattern: str | None = None,
) -> dict:
    """Train one step on this rank's replica and compare with the single-process reference."""
    spec = MODELS[model_name] if model_name in MODELS else _custom(model_name)
    groups = build_replica_groups([Replica(config, ranks)], sequence_parallel=sequence_parallel)
    return _compare(spec, model_name, groups, micro_batches, calls, pattern)


def _compare(spec, model_name, groups, micro_batches, calls: int = 1, pattern: str | None = None) -> dict:
    """`calls` > 1 splits the micro-batches over several train_step calls that accumulate gradients; `pattern`
    defers the weight gradients (train_workers.weight_slots)."""
    model = StageModel(spec, groups.tp, groups.stage, groups.config.pp, vp=groups.config.vp)
    reset_parameters(model, SEED)
    docs = documents(spec.vocab)
    packed = [concatenate_documents([docs[i] for i in mb], pad_to_multiple=groups.config.tp) for mb in micro_batches]
    per_call = -(-len(packed) // calls)
    config = groups.config
    slots = [() if pattern is None else weight_slots(config.pp, config.vp, len(packed[i : i + per_call]),
                                                     groups.stage, pattern) for i in range(0, len(packed), per_call)]
    results = [
        train_step(model, groups, packed[i : i + per_call], count_targets(LENGTHS), deferred=slots[k])
        for k, i in enumerate(range(0, len(packed), per_call))
    ]
    loss = None if results[0].loss is None else sum(r.loss for r in results)
    grads = model.full_grads()
    evaluated = forward_step(model, groups, packed)  # forward only, as evaluation runs it: the same loss
    ref_loss, ref_grads = reference(model_name, tuple(i for mb in micro_batches for i in mb))
    errors = {}
    for name, g in grads.items():
        ref = ref_grads[name]
        assert g.shape == ref.shape, (name, g.shape, ref.shape)
        errors[name] = float((g - ref).norm() / ref.norm())
    return {
        "config": groups.config.name,
        "stage": groups.stage,
        "tp_rank": groups.tp.rank,
        "loss": loss,
        "eval_loss": None if evaluated is None else float(evaluated) / count_targets(LENGTHS),
        "pp": groups.config.pp,
        "vp": groups.config.vp,
        "schedules": [r.order for r in results],
        "slots": slots,
        "ref_loss": ref_loss,
        "errors": errors,
        "all_params": sorted(ref_grads),
    }


def check_configs(rank: int, world: int) -> dict:
    """Several layouts on 4 ranks; each rank reports what it holds."""
    out = {}
    # tp2 x pp2 on contiguous ranks, then with sequence parallelism on a permuted rank list.
    out["tp2pp2"] = run_replica("tiny", ParallelConfig(2, 2), (0, 1, 2, 3), MICRO_BATCHES, False)
    # (also accumulating gradients over two train_step calls)
    out["tp2pp2-sp"] = run_replica("tiny", ParallelConfig(2, 2), (3, 1, 0, 2), MICRO_BATCHES, True, calls=2)
    # Two replicas with different configs in one job, each on part of the batch (non-contiguous ranks).
    a, b = Replica(ParallelConfig(2, 1), (0, 2)), Replica(ParallelConfig(1, 2), (3, 1))
    groups = build_replica_groups([a, b], sequence_parallel=True)
    mbs = MICRO_BATCHES[:2] if rank in a.devices else MICRO_BATCHES[2:]
    out["hetero"] = _compare(MODELS["tiny"], "tiny", groups, mbs)
    # One micro-batch on two stages (warm-up and cool-down only); MQA with tp2 (replicated KV head).
    c, d = Replica(ParallelConfig(1, 2), (2, 0)), Replica(ParallelConfig(2, 1), (1, 3))
    groups = build_replica_groups([c, d], sequence_parallel=False)
    if rank in c.devices:
        out["pp2-one-mb"] = _compare(MODELS["tiny-mha"], "tiny-mha", groups, MICRO_BATCHES[2:3])
    else:
        out["tp2-mqa"] = _compare(_custom("tiny-mqa"), "tiny-mqa", groups, MICRO_BATCHES)
    # Interleaved 1F1B, two model chunks per rank: with TP and SP on one replica; beside a tp2 replica, on three
    # micro-batches (Megatron's group of three) of the batch.
    out["tp2pp2vp2-sp"] = run_replica("tiny", ParallelConfig(2, 2, vp=2), (2, 0, 3, 1), MICRO_BATCHES, True)
    e, f = Replica(ParallelConfig(2, 1), (1, 2)), Replica(ParallelConfig(1, 2, vp=2), (0, 3))
    groups = build_replica_groups([e, f], sequence_parallel=True)
    out["hetero-vp2"] = _compare(MODELS["tiny"], "tiny", groups, MICRO_BATCHES[:1] if rank in e.devices
                                 else MICRO_BATCHES[1:])
    # The same two with each backward's weight gradients deferred (zero-bubble W's): all to the stage's end, and
    # each right before the stage's next forward (the tp2 replica's too, through the lockstep executor).
    out["tp2pp2vp2-sp-zb"] = run_replica("tiny", ParallelConfig(2, 2, vp=2), (2, 0, 3, 1), MICRO_BATCHES, True,
                                         pattern="end")
    out["hetero-vp2-zb"] = _compare(MODELS["tiny"], "tiny", groups, MICRO_BATCHES[:1] if rank in e.devices
                                    else MICRO_BATCHES[1:], pattern="before-forward")
    out["collective-peaks"] = collective_peaks()
    from hydraulis.runtime.parallelism import collectives

    out["late-waits"] = collectives.late_waits
    return out


def collective_peaks(rounds: tuple[int, ...] = (2, 30)) -> dict[str, list[float]]:
    """The CPU meter's peak (MiB) over `rounds` of each TP collective on 1 MiB, its result dropped at once: with every
    free seen by the meter it does not grow with the rounds (a free left to gloo's worker thread would count)."""
    from hydraulis.runtime.metering.memory_meter import PeakMeter
    from hydraulis.runtime.parallelism.tensor_parallel import TensorParallel, enter_tp_region, exit_tp_region

    x = torch.ones(1 << 16, 4)
    peaks: dict[str, list[float]] = {}
    # forward's collectives: the all-reduce of a row-parallel output, and under SP the tokens' gather and scatter
    for name, sp, op in (("all-reduce", False, exit_tp_region), ("all-gather", True, enter_tp_region),
                         ("reduce-scatter", True, exit_tp_region)):
        tp = TensorParallel(dist.get_world_size(), dist.get_rank(), dist.group.WORLD, sequence_parallel=sp)
        for n in rounds:
            with PeakMeter() as meter:
                for _ in range(n):
                    op(x, tp)
            peaks.setdefault(name, []).append(meter.peak_bytes / 2**20)
    return peaks


def raise_on_rank_one(rank: int, world: int) -> None:
    """Rank 1 raises; rank 0 waits in a collective that can never complete."""
    if rank == 1:
        raise ValueError("rank 1 failed on purpose")
    dist.all_reduce(torch.ones(1))
    time.sleep(120)


def abort_on_rank_one(rank: int, world: int) -> None:
    """Rank 1 dies by a signal, as a gloo abort would; rank 0 waits in a collective."""
    if rank == 1:
        os.abort()
    dist.all_reduce(torch.ones(1))
    time.sleep(120)
