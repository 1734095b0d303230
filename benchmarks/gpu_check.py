"""A prepared check of the CUDA paths the CPU tests cannot reach: one GPU, under 5 minutes.

1. varlen attention: `packed_attention` on a packed bf16 micro-batch (GQA) on the device, output and
   every input gradient against an fp32 CPU reference (explicit scores, mask and softmax per document);
2. CP attention: a long document split by `split_for_cp` for cp 4, every chunk through
   `chunk_attention` (diagonal block + prefix block, merged by LSE) in bf16 on the device, all
   emulated in one process (no K/V all-gather), against the same fp32 reference of the whole document;
3. one replica's training step of a model preset (1x(tp1,pp1), bf16, the Trainer's own iteration:
   gather, forward, backward, reduce, AdamW), timed with CUDA events after warm-up steps; MFU from
   the model FLOPs of the batch (6 x parameters per token + 6 x hidden x layers x sum s^2, the
   analytic cost model's arithmetic) over the device's dense bf16 peak;
4. the peak memory of those steps as the Trainer measures it (`torch.cuda.max_memory_allocated`;
   on CPU the allocator's events) against its memory model's prediction (`cost.memory.rank_memory`),
   both from the Trainer's own metrics (runtime/metering/step_memory.py).

Attention errors above their bf16 tolerance make the exit status 1; timing, MFU and memory are
reported figures. Without CUDA it exits 2 with one line; `--device cpu` is a smoke mode that runs the
same code on CPU at small sizes (no CUDA events there: wall clock).

    .venv/bin/python benchmarks/gpu_check.py [--model small] [--tokens 65536] [--steps 5] [--json out.json]
    .venv/bin/python benchmarks/gpu_check.py --device cpu
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from hydraulis.context import split_for_cp
from hydraulis.cost import AnalyticCostModel
from hydraulis.data.sampler import TokenBudgetSampler
from hydraulis.errors import HydraulisError
from hydraulis.optim import OptimSettings
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.planner import Planner
from hydraulis.specs import ClusterSpec, ModelSpec, get_device, get_model

# bf16 keeps 8 significant bits (relative rounding 2^-9): errors of a few roundings pass, a wrong mask,
# block merge or LSE (errors of order one) does not.
OUTPUT_TOLERANCE = 1e-2
GRAD_TOLERANCE = 2e-2
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12}  # dense bf16
SIZES = {  # (documents of the varlen check, CP document length, heads, kv heads, head dim)
    "cuda": ((4096, 1, 777, 2048, 3000, 130), 8192, 16, 4, 128),
    "cpu": ((96, 1, 33, 70), 600, 4, 2, 64),
}
CP = 4


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths) -> tuple[torch.Tensor, tuple]:
    """fp32 on CPU, causal within each document: scores, mask and softmax written out; and its fp32 leaves."""
    q, k, v = (t.detach().float().cpu().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = q[start : start + n], k[start : start + n], v[start : start + n]
        scores = torch.einsum("qhd,khd->hqk", qs, ks.repeat_interleave(group, 1)) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs.repeat_interleave(group, 1)))
        start += n
    return torch.cat(outs), (q, k, v)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return float((got - want).norm() / want.norm())


def random_qkv(total: int, heads: int, kv_heads: int, dim: int, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    make = lambda h, s: (s * torch.randn(total, h, dim, generator=g)).to(device, torch.bfloat16)  # noqa: E731
    return [t.requires_grad_() for t in (make(heads, 1.5), make(kv_heads, 1.5), make(kv_heads, 1.0))]


def compare(out: torch.Tensor, inputs, lengths) -> dict:
    """Output and input gradients (one random upstream gradient) against the fp32 CPU reference."""
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    grads = torch.autograd.grad(out, inputs, dout.to(out.device, out.dtype))
    ref, ref_inputs = dense_reference(*inputs, lengths)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dout)
    errors = {"out": rel_err(out, ref)}
    errors.update({f"d{n}": rel_err(a, b) for n, a, b in zip("qkv", grads, ref_grads, strict=True)})
    ok = errors["out"] <= OUTPUT_TOLERANCE and all(errors[f"d{n}"] <= GRAD_TOLERANCE for n in "qkv")
    return {"rel_err": errors, "ok": ok}


def check_varlen(device: torch.device) -> dict:
    from hydraulis.runtime.modeling.attention import attention_backend, packed_attention

    lengths, _, heads, kv_heads, dim = SIZES[device.type]
    q, k, v = random_qkv(sum(lengths), heads, kv_heads, dim, device, seed=1)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    out = packed_attention(q, k, v, cu, max(lengths))
    return {"backend": attention_backend(device, torch.bfloat16, dim), "tokens": sum(lengths),
            **compare(out, (q, k, v), lengths)}


def check_cp(device: torch.device) -> dict:
    """Every chunk of a cp-4 zigzag split, each against its prefix, in one process."""
    from hydraulis.runtime.modeling.blockwise_attention import block_kernel, chunk_attention

    _, length, heads, kv_heads, dim = SIZES[device.type]
    q, k, v = random_qkv(length, heads, kv_heads, dim, device, seed=2)
    split = split_for_cp([length], CP)
    chunks = sorted((int(a), int(b)) for r in range(CP) for a, b in zip(*split.segments(r)[1:], strict=True))
    assert chunks[0][0] == 0 and chunks[-1][1] == length and len(chunks) == 2 * CP
    out = torch.cat([chunk_attention(q[a:b], k[a:b], v[a:b], k[:a], v[:a]) for a, b in chunks])
    return {"kernel": block_kernel(device, torch.bfloat16, dim).name, "document": length,
            "chunks": [b - a for a, b in chunks], **compare(out, (q, k, v), [length])}


def training_flops(model: ModelSpec, lengths) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward), causal attention, no recompute."""
    lengths = np.asarray(lengths, dtype=np.float64)
    per_token = 6.0 * (model.layers * model.params_per_layer + model.hidden * model.vocab)
    return per_token * lengths.sum() + 6.0 * model.hidden * model.layers * float((lengths**2).sum())


def check_step(device: torch.device, model: ModelSpec, tokens: int, steps: int) -> dict:
    """The Trainer's iteration on one rank, 1x(tp1,pp1), bf16: time, MFU, peak memory against the model."""
    from hydraulis.runtime.launch import init_distributed
    from hydraulis.runtime.trainer import Trainer, TrainSettings

    cuda = device.type == "cuda"
    spec = get_device("h200-141g" if cuda else "cpu")
    cost = AnalyticCostModel(model, spec, configs=[ParallelConfig(1, 1)])
    pool = (Deployment.parse("1x(tp1,pp1)", ClusterSpec(1, 1)),)
    config = ParallelConfig(1, 1)
    max_len = min(tokens, 8192, cost.cap(config, 1))
    if max_len < 1:
        raise HydraulisError(f"model {model.name} does not fit one {spec.name} by the memory model")
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(np.log(max_len / 4), 1.0, size=4 * tokens // max_len + 64).astype(int) + 1,
                         max_len)
    corpus = [rng.integers(0, model.vocab, size=int(n)).astype(np.uint32) for n in lengths]
    sampler = TokenBudgetSampler(lengths, tokens, max_len, seed=1)
    warmup = 2
    # memory_every=1: every step's memory measured (CUDA always is; CPU smoke mode samples otherwise)
    settings = TrainSettings(
        model, pool, cost, OptimSettings(lr=1e-4, warmup=1), warmup + steps, dtype="bf16", memory_every=1
    )
    trainer = Trainer(settings, corpus, sampler, init_distributed(device.type))
    planner = Planner(cost, 1, pool)
    batches = sampler.batches(warmup + steps)
    plans = [planner.plan(b.lengths, i) for i, b in enumerate(batches)]
    times, losses, timed_metrics = [], [], []
    for i, (batch, plan) in enumerate(zip(batches, plans, strict=True)):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            metrics = trainer.run_iteration(batch, plan)
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            begin = time.perf_counter()
            metrics = trainer.run_iteration(batch, plan)
            seconds = time.perf_counter() - begin
        losses.append(metrics.loss)
        if i >= warmup:
            times.append(seconds)
            timed_metrics.append(metrics)
    trainer.close()
    timed = batches[warmup:]
    flops = sum(training_flops(model, b.lengths) for b in timed)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), spec.peak_flops)
    largest = max(sum(int(plan.lengths[j]) for j in mb) for plan in plans[warmup:]
                  for r in plan.replicas for mb in r.micro_batches)
    # The Trainer measures and predicts every iteration's peak (runtime/metering/step_memory.py): one implementation.
    predicted = max(m.memory_predicted_bytes for m in timed_metrics)
    measured = max(m.memory_peak_bytes or 0 for m in timed_metrics)  # CUDA measures every step
    return {
        "model": model.name,
        "tokens_per_step": [int(b.lengths.sum()) for b in timed],
        "step_s": times,
        "tokens_per_s": sum(int(b.lengths.sum()) for b in timed) / sum(times),
        "mfu": flops / sum(times) / peak,
        "peak_flops": peak,
        "losses": losses,
        "memory_peak_bytes": measured,
        "memory_predicted_bytes": predicted,
        "memory_measured_over_predicted": measured / predicted,
        "largest_micro_batch": largest,
        "ok": all(np.isfinite(losses)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the smoke mode")
    parser.add_argument("--model", default=None, help="model preset (default: small, cpu tiny)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per step (default: 65536, cpu 2048)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps after 2 warm-up (default: 5, cpu 1)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device; run it on a GPU, or pass --device cpu "
              "for the CPU smoke mode", file=sys.stderr)
        return 2
    cpu = args.device == "cpu"
    try:
        model = get_model(args.model or ("tiny" if cpu else "small"))
        tokens = args.tokens if args.tokens is not None else (2048 if cpu else 65536)
        steps = args.steps if args.steps is not None else (1 if cpu else 5)
        if tokens < 1 or steps < 1:
            raise HydraulisError(f"--tokens and --steps must be positive, got {tokens} and {steps}")
        device = torch.device(args.device)
        begin = time.perf_counter()
        report = {"device": "cpu" if cpu else torch.cuda.get_device_name(), "torch": torch.__version__}
        report.update(varlen=check_varlen(device), cp=check_cp(device), step=check_step(device, model, tokens, steps))
    except HydraulisError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    report["wall_s"] = time.perf_counter() - begin
    v, c, s = report["varlen"], report["cp"], report["step"]
    fmt = lambda e: ", ".join(f"{k} {x:.1e}" for k, x in e.items())  # noqa: E731
    print(f"gpu_check on {report['device']}, torch {report['torch']} ({'smoke mode' if cpu else 'bf16'})")
    print(f"  varlen attention [{v['backend']}], {v['tokens']} tokens: rel err {fmt(v['rel_err'])} "
          f"{'ok' if v['ok'] else 'FAILED'}")
    print(f"  CP attention [{c['kernel']}], document {c['document']} as chunks {c['chunks']}: rel err "
          f"{fmt(c['rel_err'])} {'ok' if c['ok'] else 'FAILED'}")
    print(f"  training step {s['model']} 1x(tp1,pp1) bf16: {np.median(s['step_s']) * 1e3:.1f} ms median, "
          f"{s['tokens_per_s']:,.0f} tokens/s ({np.mean(s['tokens_per_step']):,.0f} tokens a step), "
          f"MFU {s['mfu']:.1%} of {s['peak_flops'] / 1e12:.3g} TFLOP/s")
    print(f"  memory: peak {s['memory_peak_bytes'] / 2**30:.2f} GiB measured, "
          f"{s['memory_predicted_bytes'] / 2**30:.2f} GiB predicted ({s['memory_measured_over_predicted']:.2f}x)")
    print(f"  wall {report['wall_s']:.1f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)
    return 0 if v["ok"] and c["ok"] and s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
