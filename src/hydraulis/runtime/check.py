"""`hydraulis check`: whether this machine runs the runtime correctly, and how fast, in one process.

1. varlen attention: `varlen_attention` on a packed micro-batch of documents (GQA) in bf16 on the device,
   output and every input gradient against an fp32 CPU reference computed apart from it: plain
   softmax(Q K^T / sqrt(d)) V over the whole packed sequence under a mask that lets a token see only the
   earlier tokens of its own document;
2. CP attention: a long document split by `split_for_cp` for cp 4, every chunk through `chunk_attention`
   (diagonal block + prefix block, merged by LSE) in bf16 on the device, emulated in one process (no K/V
   all-gather), against the same reference of the whole document;
3. one replica's training step of a model preset (1x(tp1,pp1), the Trainer's own iteration: gather,
   forward, backward, reduce, AdamW) after warm-up steps, timed with CUDA events (on CPU the wall clock);
   MFU from the model FLOPs of the batch (6 x parameters per token + 6 x hidden x layers x sum s^2, the
   analytic cost model's arithmetic) over the device's dense bf16 peak;
4. the peak memory of those steps as the Trainer measures it (`torch.cuda.max_memory_allocated`; on CPU the
   allocator's events) against its memory model's prediction, both the Trainer's own metrics
   (runtime/metering/step_memory.py); under a memory budget, that no step went over it.

Attention errors above their bf16 tolerance, a non-finite loss or a step over the budget make `ok` false
(the command exits 1); time, MFU and memory against the model are reported figures.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import torch

from hydraulis.context import split_for_cp
from hydraulis.cost import AnalyticCostModel
from hydraulis.data.sampler import GlobalBatch, TokenBudgetSampler
from hydraulis.errors import HydraulisError
from hydraulis.limits import DEFAULT_EXCHANGE_BUCKET_BYTES
from hydraulis.optim import OptimSettings
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.planner import Planner
from hydraulis.runtime.metering import machine
from hydraulis.runtime.parallelism.batch import TokenDocuments
from hydraulis.settings import ParallelSettings, TrainerSettings, TrainSettings
from hydraulis.specs import DTYPE_BYTES, ClusterSpec, ModelSpec

# bf16 keeps 8 significant bits (relative rounding 2^-9): errors of a few roundings pass, a wrong mask,
# block merge or LSE (errors of order one) does not.
OUTPUT_TOLERANCE = 1e-2
GRAD_TOLERANCE = 2e-2
SIZES = {  # (documents of the varlen check, CP document length, heads, kv heads, head dim)
    "cuda": ((4096, 1, 777, 2048, 3000, 130), 8192, 8, 2, 128),
    "cpu": ((96, 1, 33, 70), 600, 4, 2, 64),
}
CP = 4
WARMUP = 2  # untimed steps first (allocator, kernels' first calls)
FULL = 0.9  # a step's batch holds at least this share of --tokens


def document_mask(lengths) -> torch.Tensor:
    """(T, T) bool: token i sees token j when both are in one document and j <= i."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(list(lengths)))
    return (doc[:, None] == doc[None, :]) & torch.ones(len(doc), len(doc), dtype=torch.bool).tril()


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths) -> tuple[torch.Tensor, tuple]:
    """fp32 on CPU over the whole packed sequence: scores, the document mask and softmax written out;
    and its fp32 leaves. A head at a time, so the scores of one head are the largest transient."""
    q, k, v = (t.detach().float().cpu().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    hidden = ~document_mask(lengths)
    heads = []
    for h in range(q.shape[1]):
        scores = (q[:, h] @ k[:, h // group].T) / q.shape[-1] ** 0.5
        heads.append(scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v[:, h // group])
    return torch.stack(heads, 1), (q, k, v)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return float((got - want).norm() / want.norm())


def random_qkv(total: int, heads: int, kv_heads: int, dim: int, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    make = lambda h, s: (s * torch.randn(total, h, dim, generator=g)).to(device, torch.bfloat16)  # noqa: E731
    return [t.requires_grad_() for t in (make(heads, 1.5), make(kv_heads, 1.5), make(kv_heads, 1.0))]


def compare(out: torch.Tensor, inputs, lengths) -> dict[str, Any]:
    """Output and input gradients (one random upstream gradient) against the fp32 CPU reference."""
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    grads = torch.autograd.grad(out, inputs, dout.to(out.device, out.dtype))
    ref, ref_inputs = dense_reference(*inputs, lengths)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dout)
    errors = {"out": rel_err(out, ref)}
    errors.update({f"d{n}": rel_err(a, b) for n, a, b in zip("qkv", grads, ref_grads, strict=True)})
    ok = errors["out"] <= OUTPUT_TOLERANCE and all(errors[f"d{n}"] <= GRAD_TOLERANCE for n in "qkv")
    return {"rel_err": errors, "ok": bool(ok)}


def check_varlen(device: torch.device) -> dict[str, Any]:
    from hydraulis.runtime.modeling.attention import attention_backend, varlen_attention

    lengths, _, heads, kv_heads, dim = SIZES[device.type]
    q, k, v = random_qkv(sum(lengths), heads, kv_heads, dim, device, seed=1)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, max(lengths))
    return {"kernel": attention_backend(device, torch.bfloat16, dim), "tokens": sum(lengths),
            "documents": len(lengths), **compare(out, (q, k, v), lengths)}  # fmt: skip


def check_cp(device: torch.device) -> dict[str, Any]:
    """Every chunk of a cp-4 zigzag split, each against its prefix, in one process."""
    from hydraulis.runtime.modeling.blockwise_attention import block_kernel, chunk_attention

    _, length, heads, kv_heads, dim = SIZES[device.type]
    q, k, v = random_qkv(length, heads, kv_heads, dim, device, seed=2)
    split = split_for_cp([length], CP)
    chunks = sorted((int(a), int(b)) for r in range(CP) for a, b in zip(*split.segments(r)[1:], strict=True))
    if chunks[0][0] != 0 or chunks[-1][1] != length or len(chunks) != 2 * CP:
        raise AssertionError(f"split_for_cp({length}, {CP}) gave chunks {chunks}")  # a bug, not bad input
    out = torch.cat([chunk_attention(q[a:b], k[a:b], v[a:b], k[:a], v[:a]) for a, b in chunks])
    return {"kernel": block_kernel(device, torch.bfloat16, dim).name, "document": length,
            "chunks": [b - a for a, b in chunks], **compare(out, (q, k, v), [length])}  # fmt: skip


def training_flops(model: ModelSpec, lengths) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward), causal attention, no recompute."""
    lengths = np.asarray(lengths, dtype=np.float64)
    per_token = 6.0 * (model.layers * model.params_per_layer + model.hidden * model.vocab)
    return per_token * lengths.sum() + 6.0 * model.hidden * model.layers * float((lengths**2).sum())


def _timed(device: torch.device, work):
    """work() and its seconds: CUDA events around it on a GPU (synchronised), the wall clock on CPU."""
    if device.type != "cuda":
        begin = time.perf_counter()
        result = work()
        return result, time.perf_counter() - begin
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    result = work()
    end.record()
    torch.cuda.synchronize(device)
    return result, start.elapsed_time(end) / 1e3


def _workload(model: ModelSpec, tokens: int, max_len: int) -> tuple[list[np.ndarray], TokenBudgetSampler]:
    """Random documents of long-tailed lengths up to max_len, and a sampler of `tokens` per batch over them."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(np.log(max_len / 4), 1.0, size=4 * tokens // max_len + 64).astype(int) + 1,
                         max_len)  # fmt: skip
    corpus = [rng.integers(0, model.vocab, size=int(n)).astype(np.uint32) for n in lengths]
    return corpus, TokenBudgetSampler(lengths, tokens, max_len, seed=1)


def _full_batches(sampler: TokenBudgetSampler, tokens: int, count: int) -> list[GlobalBatch]:
    """The sampler's first `count` batches that hold at least FULL of the budget: whole documents leave some short
    (a long one that did not fit ends them), and `--tokens` is what a timed step holds."""
    full = [b for b in itertools.islice(sampler, 64 * count) if b.lengths.sum() >= FULL * tokens]
    if len(full) < count:
        raise HydraulisError(f"--tokens {tokens}: too few batches of its documents fill it; give a larger --tokens")
    return full[:count]


def check_step(
    device: torch.device, model: ModelSpec, tokens: int, steps: int, dtype: str = "bf16", budget: int | None = None
) -> dict[str, Any]:
    """The Trainer's iteration on one rank, 1x(tp1,pp1): time, MFU, peak memory against the model (and the budget);
    and the collectives of its process group (`machine.collectives`)."""
    from hydraulis.runtime.parallelism.launch import init_distributed
    from hydraulis.runtime.trainer import Trainer

    spec, peak, peak_source = machine.device_spec(device)
    config = ParallelConfig(1, 1)
    cost = AnalyticCostModel(model, spec, configs=[config]).for_job(budget, DTYPE_BYTES[dtype],
                                                                    DEFAULT_EXCHANGE_BUCKET_BYTES)  # fmt: skip
    pool = (Deployment.parse("1x(tp1,pp1)", ClusterSpec(1, 1)),)
    max_len = min(tokens, 8192, cost.cap(config, 1))
    if max_len < 1:
        within = " within --memory-per-rank" if budget is not None else ""
        raise HydraulisError(f"model {model.name} does not fit one {spec.name}{within} by the memory model")
    corpus, sampler = _workload(model, tokens, max_len)
    train = TrainSettings(steps=WARMUP + steps, dtype=dtype, memory_every=1)  # every step measured (CPU samples)
    settings = TrainerSettings(model=model, parallel=ParallelSettings.of(pool, cost),  # the budget: the cost model's
                               optim=OptimSettings(lr=1e-4, warmup=1), train=train)
    env = init_distributed(device.type)
    trainer = Trainer(settings=settings, corpus=TokenDocuments(corpus), sampler=sampler, env=env)
    planner = Planner(cost, 1, pool)
    batches = _full_batches(sampler, tokens, WARMUP + steps)
    plans = [planner.plan(b.lengths, i) for i, b in enumerate(batches)]
    times, losses, timed = [], [], []
    out_of_memory = None
    try:
        for i, (batch, plan) in enumerate(zip(batches, plans, strict=True)):
            metrics, seconds = _timed(device, lambda b=batch, p=plan: trainer.run_iteration(b, p))
            losses.append(metrics.loss)
            if i >= WARMUP:
                times.append(seconds)
                timed.append(metrics)
    except torch.cuda.OutOfMemoryError as exc:  # the allocator's limit (a budget) or the device's memory
        out_of_memory = str(exc).splitlines()[0]
    finally:
        trainer.close()
    backends = machine.collectives(env.device)
    report: dict[str, Any] = {"model": model.name, "dtype": dtype, "collectives": backends,
                              "budget_bytes": budget, "out_of_memory": out_of_memory}  # fmt: skip
    if out_of_memory is not None or not timed:
        return {**report, "ok": False}
    batches = batches[WARMUP:]
    done = sum(int(b.lengths.sum()) for b in batches)
    flops = sum(training_flops(model, b.lengths) for b in batches)
    # The Trainer measures and predicts every iteration's peak (runtime/metering/step_memory.py): one implementation.
    sampled = [m for m in timed if m.memory_peak_bytes is not None] or timed  # steps the meter measured
    predicted = max(m.memory_predicted_bytes for m in sampled)
    measured = max((m.memory_peak_bytes for m in sampled if m.memory_peak_bytes is not None), default=None)
    over = [m.step for m in timed if m.memory_over_budget]
    return {
        **report,
        "tokens_per_step": [int(b.lengths.sum()) for b in batches],
        "step_s": times,
        "tokens_per_s": done / sum(times),
        "mfu": flops / sum(times) / peak if peak else None,
        "peak_flops": peak,
        "peak_source": peak_source,
        "losses": losses,
        "memory_peak_bytes": measured,
        "memory_predicted_bytes": predicted,
        "memory_measured_over_predicted": measured / predicted if predicted and measured is not None else None,
        "steps_over_budget": over,
        "ok": bool(all(np.isfinite(losses)) and not over),
    }


def run_check(
    device: torch.device, model: ModelSpec, tokens: int, steps: int, dtype: str = "bf16", budget: int | None = None
) -> dict[str, Any]:
    """Everything `hydraulis check` reports; `ok` is false when a correctness check failed."""
    begin = time.perf_counter()
    head_dim = SIZES[device.type][4]
    report: dict[str, Any] = {"environment": machine.environment(device), "kernels": machine.kernels(device, head_dim),
                              "head_dim": head_dim}  # fmt: skip
    report["varlen"] = check_varlen(device)
    report["cp"] = check_cp(device)
    report["step"] = check_step(device=device, model=model, tokens=tokens, steps=steps, dtype=dtype, budget=budget)
    report["profiles"] = machine.profiles(device, dtype)
    report["wall_s"] = time.perf_counter() - begin
    backends_work = all(b["works"] for b in report["step"]["collectives"].values())
    report["ok"] = bool(report["varlen"]["ok"] and report["cp"]["ok"] and report["step"]["ok"] and backends_work)
    return report

