"""Attention of a chunk over its prefix as key blocks merged by log-sum-exp: no mask, O(chunk) memory.

A chunk of a split document (global positions [a, b)) attends causally to
keys 0..b-1. Instead of one call under a dense (chunk x prefix) mask, it is
two calls, as ring attention decomposes it:

- the diagonal block: the chunk's own keys [a, b), causal;
- the prefix block: keys [0, a), all visible, no mask;

each returning its output and its rows' log-sum-exp (LSE), merged as
out = sum_i exp(lse_i - lse) out_i with lse = logaddexp(lse_1, lse_2).
Backward is one autograd function: each block's kernel backward is called
with the MERGED output and LSE, which gives exactly that block's share of
the gradient (its probabilities are exp(s - lse), its D = rowsum(dout * out)),
so nothing of size chunk x keys is kept or built.

Block kernels (`block_kernel`), chosen by device and dtype:

- `cpu-flash`: aten's `_scaled_dot_product_flash_attention_for_cpu` and its
  backward (they return / take the LSE; present in torch 2.11 and 2.13);
- `cuda-flash`: aten's `_scaled_dot_product_flash_attention` and its
  backward, where CUDA flash kernels apply (`attention.flash_applies`);
- `math`: a tiled online softmax in fp32 (tiles of `MATH_TILE` keys), any
  device and dtype; the fallback where neither op is present or applies.

Layout: q (s, Hq, D), k and v (keys, Hkv, D), Hq a multiple of Hkv; output (s, Hq, D).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hydraulis.runtime.modeling.attention import flash_applies, repeat_kv

MATH_TILE = 512  # keys per tile of the math kernel: its transient scores are (Hq, chunk, MATH_TILE)

# forward(q, k, v, causal) -> (out, lse, aux); backward(dout, q, k, v, out, lse, aux, causal) -> (dq, dk, dv).
# All tensors (1, H, rows, D), lse (1, Hq, rows) in fp32; aux is what the kernel's backward needs besides.
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor, Any]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class BlockKernel:
    """Attention of one query block over one key block that also returns the rows' LSE, and its backward."""

    name: str
    forward: Forward
    backward: Backward


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor,
    kernel: BlockKernel | None = None,
) -> torch.Tensor:
    """Causal attention of a chunk's queries over its own keys (k, v) and its fully visible prefix.

    q (s, Hq, D), k and v (s, Hkv, D): the chunk's rows; k_prefix and v_prefix (p, Hkv, D): the keys
    before it (p may be 0). Equals causal attention over the concatenation prefix + chunk.
    """
    kernel = kernel or block_kernel(q.device, q.dtype, q.shape[-1])
    heads = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731  (rows, H, D) -> (1, H, rows, D), a view
    out = _MergedBlocks.apply(heads(q), heads(k), heads(v), heads(k_prefix), heads(v_prefix), kernel)
    return out.squeeze(0).transpose(0, 1)


class _MergedBlocks(torch.autograd.Function):
    """The diagonal block (causal) and the prefix block (no mask), merged by LSE; exact backward per block."""

    @staticmethod
    def forward(ctx, q, k, v, kp, vp, kernel):
        out, lse, aux = kernel.forward(q, k, v, True)
        aux_prefix = None
        if kp.shape[2] > 0:
            out_p, lse_p, aux_prefix = kernel.forward(q, kp, vp, False)
            merged = torch.logaddexp(lse, lse_p)
            out = (out.float() * (lse - merged).exp().unsqueeze(-1)
                   + out_p.float() * (lse_p - merged).exp().unsqueeze(-1)).to(q.dtype)
            lse = merged
        ctx.kernel = kernel
        ctx.aux = aux
        ctx.aux_prefix = aux_prefix
        ctx.save_for_backward(q, k, v, kp, vp, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, kp, vp, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ctx.kernel.backward(dout, q, k, v, out=out, lse=lse, aux=ctx.aux, causal=True)
        dkp = dvp = None  # an empty prefix has no gradient
        if kp.shape[2] > 0:
            dq_p, dkp, dvp = ctx.kernel.backward(dout, q, kp, vp, out=out, lse=lse, aux=ctx.aux_prefix, causal=False)
            dq = dq + dq_p
        return dq, dk, dv, dkp, dvp, None


# ------------------------------------------------------------------ block kernels


def block_kernel(device: torch.device | str, dtype: torch.dtype, head_dim: int = 128) -> BlockKernel:
    """The fastest block kernel for tensors of this device, dtype and head size (see the module docstring)."""
    if torch.device(device).type == "cpu" and _cpu_flash() is not None:
        return _cpu_flash()
    if flash_applies(device, dtype, head_dim) and _cuda_flash() is not None:
        return _cuda_flash()
    return MATH


@functools.cache
def _cpu_flash() -> BlockKernel | None:
    forward_op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward_op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward_op is None or backward_op is None:
        return None

    def forward(q, k, v, causal):
        out, lse = forward_op(q, k, v, 0.0, causal)  # GQA (fewer K/V heads) is native
        return out, lse, None

    def backward(dout, q, k, v, out, lse, aux, causal):
        return backward_op(dout, q, k, v, out=out, logsumexp=lse, dropout_p=0.0, is_causal=causal)

    return BlockKernel("cpu-flash", forward, backward)


@functools.cache
def _cuda_flash() -> BlockKernel | None:
    forward_op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
    backward_op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward", None)
    if forward_op is None or backward_op is None:
        return None

    def forward(q, k, v, causal):
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = forward_op(q, k, v, 0.0, causal)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(dout, q, k, v, out, lse, aux, causal):
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        group = q.shape[1] // k.shape[1]
        dq, dk, dv = backward_op(
            dout, q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]), out=out, logsumexp=lse,
            cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=max_q, max_k=max_k, dropout_p=0.0, is_causal=causal,
            philox_seed=seed, philox_offset=offset,
        )
        return dq, _sum_heads(dk, group), _sum_heads(dv, group)

    return BlockKernel("cuda-flash", forward, backward)


def _math_forward(q, k, v, causal):
    """Online softmax over tiles of MATH_TILE keys, in fp32: never more than (Hq, rows, MATH_TILE) scores."""
    group = q.shape[1] // k.shape[1]
    qf = q.float() * q.shape[-1] ** -0.5
    rows = q.shape[2]
    peak = torch.full(qf.shape[:-1], float("-inf"), device=q.device)
    total = torch.zeros_like(peak)
    acc = torch.zeros_like(qf)
    for start in range(0, k.shape[2], MATH_TILE):
        if causal and start >= rows:
            break
        scores = _tile_scores(qf, k, start, group, causal)
        new_peak = torch.maximum(peak, scores.amax(-1))
        keep = (peak - new_peak).exp()
        p = (scores - new_peak.unsqueeze(-1)).exp()
        total = total * keep + p.sum(-1)
        acc = acc * keep.unsqueeze(-1) + p @ repeat_kv(v[:, :, start : start + MATH_TILE], q.shape[1]).float()
        peak = new_peak
    lse = peak + total.log()
    return (acc / total.unsqueeze(-1)).to(q.dtype), lse, None


def _math_backward(dout, q, k, v, out, lse, aux, causal):
    """Flash backward tile by tile: p = exp(s - lse), ds = p * (dout v^T - rowsum(dout * out))."""
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    qf, do = q.float() * scale, dout.float()
    delta = (do * out.float()).sum(-1, keepdim=True)
    dq = torch.zeros_like(qf)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros_like(dk)
    for start in range(0, k.shape[2], MATH_TILE):
        if causal and start >= q.shape[2]:
            break
        stop = min(start + MATH_TILE, k.shape[2])
        p = (_tile_scores(qf, k, start, group, causal) - lse.unsqueeze(-1)).exp()
        kt = repeat_kv(k[:, :, start:stop], q.shape[1]).float()
        vt = repeat_kv(v[:, :, start:stop], q.shape[1]).float()
        ds = p * (do @ vt.transpose(-1, -2) - delta)
        dq += ds @ kt
        dk[:, :, start:stop] = _sum_heads(ds.transpose(-1, -2) @ qf, group)
        dv[:, :, start:stop] = _sum_heads(p.transpose(-1, -2) @ do, group)
    return (dq * scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _tile_scores(qf: torch.Tensor, k: torch.Tensor, start: int, group: int, causal: bool) -> torch.Tensor:
    """Scaled scores of all queries against keys start..start+MATH_TILE; causal: key j > query i is -inf."""
    kt = repeat_kv(k[:, :, start : start + MATH_TILE], qf.shape[1]).float()
    scores = qf @ kt.transpose(-1, -2)
    if causal:
        rows = torch.arange(qf.shape[2], device=qf.device).unsqueeze(1)
        cols = torch.arange(start, start + kt.shape[2], device=qf.device)
        scores = scores.masked_fill(cols > rows, float("-inf"))
    return scores


def _sum_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """The gradient of `repeat_kv`: sum each group of `group` query heads onto its K/V head."""
    return x if group == 1 else x.unflatten(1, (-1, group)).sum(2)


MATH = BlockKernel("math", _math_forward, _math_backward)
