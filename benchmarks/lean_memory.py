"""Gradient sums and the loss head under bf16: accuracy, bytes and time of each way, measured in one run.

Gradients of 64 micro-batches of tiny (bf16 compute, against fp32 compute on the same bf16 weights), summed:
- `bf16 .grad`: autograd's own accumulation in the parameter's dtype (Megatron's default bf16 grad buffer);
- `fp32 main_grad`: each micro-batch's gradient added into fp32 (Megatron's grad_reduce_in_fp32; this
  runtime before);
- `bf16, fp32 every k`: bf16 sums sent to fp32 every k micro-batches (k x fewer sends than per micro-batch);
- `scaled fp16` (the runtime's, runtime/modeling/main_grad.py): fp16 times a power of two per tensor.
Relative error of the summed gradient, bytes per element it keeps, and the median time of a micro-batch's
forward and backward with the sum (small, one process, interleaved repeats).

The loss head of small (50,304 columns) on a micro-batch: whole fp32 logits and their gradient
(F.cross_entropy) against the runtime's chunks (runtime/modeling/cross_entropy.py): the peak the CPU allocator
records above the hidden states, and the median time of forward and backward.

Run: .venv/bin/python benchmarks/lean_memory.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from hydraulis.runtime import IGNORE_INDEX, StageModel, TensorParallel, concatenate_documents, head_cross_entropy
from hydraulis.runtime.metering.memory_meter import PeakMeter
from hydraulis.runtime.modeling.main_grad import attach_main_grads, clear_grads, gradient
from hydraulis.runtime.optimizer.layout import ShardLayout
from hydraulis.specs import MODELS

MICRO_BATCHES = 64


def _fp32_main_grads(model: torch.nn.Module) -> None:
    """Megatron's fp32 main_grad: each micro-batch's bf16 gradient added into fp32 and freed."""
    def hook(p: torch.Tensor) -> None:
        p.fp32_grad = p.grad.float() if p.fp32_grad is None else p.fp32_grad.add_(p.grad)
        p.grad = None

    for p in model.parameters():
        p.fp32_grad = None
        p.register_post_accumulate_grad_hook(hook)


def _summed(model: StageModel, docs: list[torch.Tensor], flush_every: int = 0) -> torch.Tensor:
    """The batch's gradient over MICRO_BATCHES backwards, as the model's hooks sum it (fp32 values);
    `flush_every` k: .grad summed in bf16 and added into an fp32 total every k micro-batches."""
    clear_grads(model.parameters())
    for p in model.parameters():
        if hasattr(p, "fp32_grad"):
            p.fp32_grad = None
    total_targets = sum(len(d) - 1 for d in docs)
    flushed = None
    for k, part in enumerate(np.array_split(np.arange(len(docs)), MICRO_BATCHES)):
        packed = concatenate_documents([docs[i] for i in part])
        loss = F.cross_entropy(model(packed.tokens, packed).float(), packed.targets, ignore_index=IGNORE_INDEX,
                               reduction="sum")
        (loss / total_targets).backward()
        if flush_every and ((k + 1) % flush_every == 0 or k == MICRO_BATCHES - 1):
            now = torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])
            flushed = now if flushed is None else flushed + now
            clear_grads(model.parameters())
    if flush_every:
        return flushed
    sums = [(p.fp32_grad, None) if hasattr(p, "fp32_grad") else gradient(p) for p in model.parameters()]
    return torch.cat([(g.float() * (1 if u is None else u)).reshape(-1) for g, u in sums])


def accuracy() -> dict[str, float]:
    spec = MODELS["tiny"]
    full = ShardLayout(spec, 1).full_state_dict(3)
    rng = np.random.default_rng(0)
    docs = [torch.from_numpy(rng.integers(0, spec.vocab, size=int(n))) for n in rng.integers(8, 32, size=64)]
    reference = StageModel(spec)
    reference.load_full_state_dict({n: v.to(torch.bfloat16).float() for n, v in full.items()})
    exact = _summed(reference, docs)

    def model(attach: Callable[[torch.nn.Module], None] | None) -> StageModel:
        m = StageModel(spec, dtype=torch.bfloat16)
        m.load_full_state_dict(full)
        if attach is not None:
            attach(m)
        return m

    def error(got: torch.Tensor) -> float:
        return float((got - exact).norm() / exact.norm())

    out = {"bf16 .grad": error(_summed(model(None), docs)),
           "fp32 main_grad": error(_summed(model(_fp32_main_grads), docs))}
    for k in (2, 4, 8):
        out[f"bf16, fp32 every {k}"] = error(_summed(model(None), docs, flush_every=k))
    out["scaled fp16"] = error(_summed(model(attach_main_grads), docs))
    return out


def _median_s(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_times(repeats: int) -> dict[str, float]:
    """Median seconds of 4 micro-batches of 256 tokens of small in bf16, per way of summing, interleaved."""
    spec = MODELS["small"]
    g = torch.Generator().manual_seed(1)
    batches = [concatenate_documents([torch.randint(0, spec.vocab, (128,), generator=g) for _ in range(2)])
               for _ in range(4)]
    models = {}
    ways = (("bf16 .grad", None), ("fp32 main_grad", _fp32_main_grads), ("scaled fp16", attach_main_grads))
    for name, attach in ways:
        m = StageModel(spec, dtype=torch.bfloat16)
        if attach is not None:
            attach(m)
        models[name] = m

    def run(m: StageModel) -> None:
        clear_grads(m.parameters())
        for p in m.parameters():
            if hasattr(p, "fp32_grad"):
                p.fp32_grad = None
        for b in batches:
            m.loss_sum(b.tokens, b).backward()

    samples = {name: [] for name in models}
    for _ in range(repeats):
        for name, m in models.items():
            samples[name].append(_median_s(lambda m=m: run(m), 1))
    return {name: statistics.median(v) for name, v in samples.items()}


def loss_head(repeats: int, tokens: int = 1024) -> dict[str, tuple[float, float]]:
    """(peak MiB above the hidden states, median s) of small's loss head, whole logits against chunks."""
    spec = MODELS["small"]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(2)
        h = torch.randn(tokens, spec.hidden, generator=g).to(dtype).requires_grad_()
        w = (torch.randn(spec.vocab, spec.hidden, generator=g) * 0.02).to(dtype).requires_grad_()
        t = torch.randint(0, spec.vocab, (tokens,), generator=g)

        def whole(h=h, w=w, t=t) -> None:
            F.cross_entropy(F.linear(h, w).float(), t, reduction="sum").backward()

        def chunked(h=h, w=w, t=t) -> None:
            head_cross_entropy(h, w, t, 0, spec.vocab, TensorParallel()).backward()

        for name, fn in (("whole logits", whole), ("chunks", chunked)):
            h.grad = w.grad = None
            with PeakMeter() as meter:
                fn()
            h.grad = w.grad = None
            seconds = _median_s(fn, repeats)
            out[f"{name} {str(dtype).removeprefix('torch.')}"] = (meter.peak_bytes / 2**20, seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    torch.set_num_threads(1)
    keeps = {"bf16 .grad": 2, "fp32 main_grad": 4, "scaled fp16": 2}
    times = step_times(args.repeats)
    print(f"gradient sums of {MICRO_BATCHES} micro-batches (tiny), relative error against fp32 compute; "
          "bytes per element kept; 4 micro-batches of small, median s (CPU, one thread)")
    for name, err in accuracy().items():
        kept = keeps.get(name, 2)
        seconds = f"{times[name]:.3f} s" if name in times else "   -"
        print(f"  {name:22s} error {err:.3e}   {kept} bytes   {seconds}")
    print("small's loss head, 1,024 tokens: peak above its inputs, median s of forward and backward")
    for name, (mib, seconds) in loss_head(args.repeats).items():
        print(f"  {name:22s} {mib:8.1f} MiB   {seconds:.3f} s")


if __name__ == "__main__":
    main()
