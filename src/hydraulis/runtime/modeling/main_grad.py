"""Gradients of a low-precision compute shard, summed over micro-batches in 2 bytes per element.

With bf16 parameters autograd accumulates `.grad` in bf16: each micro-batch's
addition rounds to bf16's 8 significant bits, so the error grows with the
micro-batch count (tiny, 64 micro-batches: 1.09e-2 relative error against
fp32 compute, against 6.9e-3 with fp32 sums). An fp32 `main_grad`
(Megatron's) fixes that at 4 bytes per element, the largest term of a GPU's
training state. Here a post-accumulate-grad hook moves each micro-batch's
gradient into a `main_grad` in fp16 scaled by a power of two per tensor and
frees the bf16 one: fp16 has 3 more significant bits than bf16, so the sum
is as accurate as fp32's (6.9e-3 there too) in 2 bytes, and nothing more
travels (`docs/results.md`, "Mixed precision", has the options measured).

The scale keeps the tensor's largest element below 2^15 (fp16 overflows at
65504): the first micro-batch's largest element goes to at most 2^9, which
leaves room for 64 more of its size; whenever a running bound of the sum
would pass 2^15, sum and scale are halved as often as needed. It all stays
on the device (no host sync). Elements more than 2^22 below the tensor's
largest lose bits (fp16's subnormals), those more than 2^33 below vanish.
The reduce multiplies by the inverse scale as it packs (exchange.py).
fp32 compute needs none of this: its `.grad` already sums in fp32.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

ACCUMULATOR = torch.float16
LIMIT = 2.0**15  # the scaled sum stays below this; fp16's largest finite value is 65504
HEADROOM = 2.0**6  # the first micro-batch's largest element goes to LIMIT / HEADROOM at most
TINY = 2.0**-100  # an all-zero gradient takes the scale of this largest element (finite, no 0 x inf)
PIECE = 1 << 20  # elements added at once: on CPU a mixed-dtype add allocates temporaries of its size

Gradient = tuple[torch.Tensor | None, torch.Tensor | None]  # what a parameter summed, and the factor to its value


def attach_main_grads(model: torch.nn.Module) -> None:
    """Sum every parameter's gradient into a scaled fp16 `main_grad` (allocated by the first micro-batch)."""
    for p in model.parameters():
        p.main_grad = None
        p.register_post_accumulate_grad_hook(_accumulate)


def largest(values: torch.Tensor) -> torch.Tensor:
    """The largest magnitude (fp32 device scalar; NaN if any is). aminmax: a tenth of vector_norm's time on CPU."""
    low, high = torch.aminmax(values)
    return torch.maximum(high, -low).float()


def scale_for(values: torch.Tensor, headroom: float = HEADROOM) -> tuple[torch.Tensor, torch.Tensor]:
    """The power of two that takes the largest of `values` to at most LIMIT / headroom, and that largest
    (device scalars: no host sync)."""
    top = largest(values).clamp_min(TINY)
    return torch.exp2(torch.floor(torch.log2(LIMIT / headroom / top))), top


@torch.no_grad()
def _accumulate(p: torch.Tensor) -> None:
    g = p.grad
    if p.main_grad is None:
        p.main_grad_scale, top = scale_for(g)
        p.main_grad = torch.empty_like(g, dtype=ACCUMULATOR)
        p.main_grad.copy_(g.mul_(p.main_grad_scale))
        p.main_grad_bound = top * p.main_grad_scale
        p.grad = None
        return
    # Halve sum and scale as often as the bound of the new sum exceeds LIMIT (a factor of 1 otherwise).
    bound = p.main_grad_bound + largest(g) * p.main_grad_scale
    factor = 1 / torch.exp2(torch.ceil(torch.log2((bound / LIMIT).clamp_min(1.0))))
    p.main_grad.mul_(factor)
    p.main_grad_scale = p.main_grad_scale * factor
    p.main_grad_bound = bound * factor
    accumulate_into(p.main_grad, g.mul_(p.main_grad_scale))  # exact: a power of two, well inside bf16's range
    p.grad = None


def accumulate_into(total: torch.Tensor, part: torch.Tensor) -> None:
    """total += part in total's dtype, in pieces: on CPU an in-place add of another dtype allocates
    temporaries of the whole tensor (12 bytes per element measured for fp16 += bf16)."""
    total, part = total.view(-1), part.reshape(-1)
    for a in range(0, part.numel(), PIECE):
        total[a : a + PIECE].add_(part[a : a + PIECE].to(total.dtype))


def gradient(p: torch.Tensor) -> Gradient:
    """What a parameter accumulated and the factor that gives its value: the scaled main_grad and the inverse
    of its scale where it has one, else `.grad` and None (a factor of 1)."""
    main = getattr(p, "main_grad", None)
    if main is None:
        return p.grad, None
    return main, 1 / p.main_grad_scale


def clear_grads(params: Iterable[torch.Tensor]) -> None:
    """Drop the gradients (and main gradients) of `params`, so the next backward allocates them afresh."""
    for p in params:
        p.grad = None
        if getattr(p, "main_grad", None) is not None:
            p.main_grad = None
