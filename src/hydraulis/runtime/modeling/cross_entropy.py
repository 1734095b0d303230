"""The loss head: vocab-parallel cross-entropy in chunks of rows, so a micro-batch's logits never exist whole.

Why: the head's fp32 logits and their gradient took 8 bytes x vocab / tp per
token, two thirds of `small`'s activations and about 2.6 GB of llama-7b's
at tp2 and 20K tokens. `head_cross_entropy` takes the final hidden states
and the head's weight instead of the logits (Liger's fused linear
cross-entropy): for each chunk of rows it computes the chunk's logits in the
compute dtype, the fp32 softmax with Megatron's vocab-parallel max and sum
(all-reduced over the TP group, so each rank holds vocab / tp columns), the
loss, and at once the chunk's gradients, softmax - one-hot: into the hidden
states' gradient (its rows) and the weight's (an fp32 accumulator, so the
chunks add without rounding). Backward only scales both by the incoming
gradient of the loss sum. No head GEMM is computed twice.

Chunks hold `loss_chunk_rows` rows (cost/activations.py, which counts what they
keep): a fixed number of logits (2^24, 96 MiB in the compute dtype and fp32
together), and at least 256 rows so that each chunk's GEMM stays efficient.
Padded vocabulary columns (`ModelSpec.padded_vocab`) are -inf: no
probability, no gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hydraulis.cost.activations import loss_chunk_rows
from hydraulis.runtime.modeling.main_grad import accumulate_into
from hydraulis.runtime.parallelism.batch import IGNORE_INDEX
from hydraulis.runtime.parallelism.tensor_parallel import TensorParallel


def _chunk_loss(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid: int, tp: TensorParallel, grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row loss of a chunk (fp32 or wider) and, if `grad`, d(loss sum)/d(logits), written over the logits."""
    x = logits.to(_wide(logits.dtype))  # fp32 compute: the logits themselves, which nothing else reads
    if valid < x.shape[-1]:
        x[:, valid:] = float("-inf")
    ignored = targets == IGNORE_INDEX
    local = targets - vocab_start
    not_here = ignored | (local < 0) | (local >= valid)
    local = local.masked_fill(not_here, 0)
    row_max = x.amax(dim=-1)
    if tp.size > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp.group)
    target = (x.gather(-1, local.unsqueeze(-1)).squeeze(-1) - row_max).masked_fill(not_here, 0.0)
    exp = x.sub_(row_max.unsqueeze(-1)).exp_()
    both = torch.stack([target, exp.sum(dim=-1)])
    if tp.size > 1:
        dist.all_reduce(both, group=tp.group)
    target, sum_exp = both[0], both[1]
    loss = (sum_exp.log() - target).masked_fill(ignored, 0.0)
    if not grad:
        return loss, None
    softmax = exp.div_(sum_exp.unsqueeze(-1))
    rows = torch.arange(softmax.shape[0], device=softmax.device)
    softmax[rows, local] -= (~not_here).to(softmax.dtype)
    return loss, softmax.mul_((~ignored).to(softmax.dtype).unsqueeze(-1))


def _chunk(
    hc: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid: int, tp: TensorParallel,
    grad_h: torch.Tensor | None, grad_w: torch.Tensor | None,
) -> torch.Tensor:
    """One chunk of rows: its loss sum, and its gradients written into `grad_h` and added into `grad_w`.

    A function of its own so that the chunk's logits are freed before the next chunk's exist.
    """
    want = grad_h is not None or grad_w is not None
    loss, g = _chunk_loss(F.linear(hc, weight), targets, vocab_start=vocab_start, valid=valid, tp=tp, grad=want)
    if g is None:
        return loss.sum()
    g = g.to(hc.dtype)  # the fp32 one is freed here
    if grad_h is not None:
        torch.mm(g, weight, out=grad_h)
    if grad_w is not None:
        if g.dtype == grad_w.dtype:
            grad_w.addmm_(g.t(), hc)
        else:  # a GEMM in the compute dtype, summed in fp32 without an fp32 copy of it
            accumulate_into(grad_w, g.t() @ hc)
    return loss.sum()


def _wide(dtype: torch.dtype) -> torch.dtype:
    """fp32, or the dtype itself if wider (fp64 in tests)."""
    return torch.promote_types(dtype, torch.float32)


class _HeadCrossEntropy(torch.autograd.Function):
    """Sum of token losses from hidden states and the head's vocab shard; gradients computed in forward."""

    @staticmethod
    def forward(ctx, h, weight, targets, vocab_start, valid, tp):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=_wide(weight.dtype), device=weight.device) if want_w else None
        total = torch.zeros((), dtype=_wide(h.dtype), device=h.device)
        rows = loss_chunk_rows(h.shape[0], weight.shape[0])
        for a in range(0, h.shape[0], rows):
            total += _chunk(
                h[a : a + rows], weight, targets[a : a + rows], vocab_start=vocab_start, valid=valid, tp=tp,
                grad_h=None if grad_h is None else grad_h[a : a + rows], grad_w=grad_w,
            )
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_total.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_total).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None


def head_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid: int, tp: TensorParallel
) -> torch.Tensor:
    """Sum over rows of the cross-entropy of logits h @ weight^T (fp32, or wider); IGNORE_INDEX targets add 0.

    h: (T, hidden), the final normed hidden states every TP rank holds whole; weight: this rank's
    (vocab / tp, hidden) shard, whose first `valid` rows are real vocabulary; its columns start at
    `vocab_start`. Gradients flow to h (partial over TP ranks, as a column-parallel linear's input) and weight.
    """
    return _HeadCrossEntropy.apply(h, weight, targets, vocab_start, valid, tp)
