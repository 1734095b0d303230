"""fp32 main gradients under low-precision compute (Megatron's `main_grad`).

With bf16 parameters autograd accumulates `.grad` in bf16, so every
micro-batch's addition rounds to 8 mantissa bits and the error grows with
the micro-batch count. A post-accumulate hook instead moves each
micro-batch's gradient into an fp32 `main_grad` as soon as autograd has
produced it and frees the bf16 one, so accumulation is fp32 whatever the
micro-batch count, and the optimizer's reduce reads `main_grad`.
fp32 compute needs none of this: its `.grad` already accumulates in fp32.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def attach_main_grads(model: torch.nn.Module) -> None:
    """Accumulate every parameter's gradient into an fp32 `main_grad` (allocated by the first micro-batch)."""
    for p in model.parameters():
        p.main_grad = None
        p.register_post_accumulate_grad_hook(_accumulate)


def _accumulate(p: torch.Tensor) -> None:
    if p.main_grad is None:
        p.main_grad = p.grad.to(torch.float32)
    else:
        p.main_grad.add_(p.grad)
    p.grad = None


def gradient(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient a parameter has accumulated: its fp32 main_grad where it has one, else `.grad`."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def clear_grads(params: Iterable[torch.Tensor]) -> None:
    """Drop the gradients (and main gradients) of `params`, so the next backward allocates them afresh."""
    for p in params:
        p.grad = None
        if getattr(p, "main_grad", None) is not None:
            p.main_grad = None
