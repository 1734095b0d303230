"""Weight gradients deferred out of a backward (zero-bubble pipelines, issue 50 item 3): the backward of a
micro-batch's chunk split into B, the input gradients that the stage before waits for, and W, the weight
gradients, which the pipeline runs later in a gap (`pipeline_order.with_weights` places them).

Inside `deferral()` the model's column and row linears (`linear`: attention's q, k, v, o and the MLP's w1, w3,
w2) run as one autograd Function whose backward returns the input gradient and, while a B runs
(`WeightGradStore.collect`), keeps (weight, input, output gradient) instead of the weight gradient: what the
planner's oracle counts (`zero_bubble.weight_grad_bytes`); the B frees the rest of the chunk's activations.
`WeightGradStore.run_oldest` later computes each kept weight's gradient, grad_output^T input, as a node of a new
autograd graph whose leaf is the parameter, so it adds into `.grad` through autograd's own accumulation and
every post-accumulate hook (main_grad.py's fp16 sums, the exchange's reduce) fires as after a fused backward.
The W's run oldest first, so each parameter sums its micro-batches in the fused order: the gradients equal a
fused backward's bit for bit. Everything else stays in B: the norms' weights, biases, the embedding, the head
(tied or not), the replicated K/V of tp above the KV heads, and every TP and CP collective.
Outside `deferral()` `linear` is `F.linear` itself: a step without deferral runs today's code.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

Kept = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (weight, input, output gradient) of one linear


class WeightGradStore:
    """One step's deferred W's: what the running B keeps (`collecting`), and the B's units, oldest first."""

    def __init__(self) -> None:
        self.collecting: list[Kept] | None = None  # a B runs: its linears keep their W's here
        self.units: deque[list[Kept]] = deque()

    @contextmanager
    def collect(self) -> Iterator[None]:
        """A B: every linear's weight gradient is kept, as one unit (the W of this micro-batch and chunk)."""
        self.collecting = []
        try:
            yield
            self.units.append(self.collecting)
        finally:
            self.collecting = None

    def run_oldest(self) -> None:
        """The oldest unit's weight gradients, added into `.grad` through autograd (its hooks fire)."""
        kept = self.units.popleft()
        if kept:
            with torch.enable_grad():
                torch.autograd.backward([_WeightGrad.apply(w, x.detach(), g.detach()) for w, x, g in kept])


_STORE: WeightGradStore | None = None  # the store of the deferring step that runs, if any


@contextmanager
def deferral() -> Iterator[WeightGradStore]:
    """Linears made inside defer their weight gradients while a B collects; the store to run them from."""
    global _STORE
    if _STORE is not None:
        raise RuntimeError("weight gradient deferral is already on")
    _STORE = WeightGradStore()
    try:
        yield _STORE
    finally:
        _STORE = None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, whose weight gradient waits for a W when made under `deferral()`."""
    if _STORE is None:
        return F.linear(x, weight, bias)
    # The weight goes in a tuple, out of autograd's sight: the B has no edge to it, so neither its accumulation
    # nor its hooks run there (they would, with no gradient); the W's graph gives it its one.
    return _DeferrableLinear.apply(x, bias, _STORE, (weight,))


def weight_grad(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """grad_output^T input over every token: the weight's gradient (out, in), as a fused backward gives it."""
    return grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, store, held):
        (weight,) = held
        ctx.store = store
        ctx.has_bias = bias is not None
        ctx.weight = weight  # the parameter itself (a checkpoint's recompute would give a detached copy)
        ctx.save_for_backward(x)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (x,), weight, kept = ctx.saved_tensors, ctx.weight, ctx.store.collecting
        if kept is None:
            raise RuntimeError("a deferring linear's backward ran outside a B (WeightGradStore.collect)")
        kept.append((weight, x, grad))
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_bias, None, None


class _WeightGrad(torch.autograd.Function):
    """A kept W as a graph node: a scalar of no value whose backward is the weight's gradient."""

    @staticmethod
    def forward(ctx, weight, x, grad):
        ctx.kept = (x, grad)
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        x, grad = ctx.kept
        ctx.kept = None
        return weight_grad(x, grad), None, None
