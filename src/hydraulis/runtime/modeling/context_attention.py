"""Attention over a CP group: exact causal attention when a micro-batch's tokens are spread over its ranks.

Which tokens each rank holds is runtime/parallelism/context_parallel.py; this is how they attend (see its
docstring for the scheme: the K/V all-gather forward, the reduce-scatter of its gradient backward).
"""

from __future__ import annotations

import torch

from hydraulis.errors import HydraulisError
from hydraulis.runtime.modeling.attention import causal_sdpa
from hydraulis.runtime.modeling.blockwise_attention import block_kernel, chunk_attention
from hydraulis.runtime.parallelism.collectives import all_gather_into, reduce_scatter_into
from hydraulis.runtime.parallelism.context_parallel import ContextParallel, ContextShard

# ---------------------------------------------------------------- the K/V all-gather

class _GatherKV(torch.autograd.Function):
    """(n, ...) local rows -> (cp * pad, ...) in CP-rank order; backward: reduce-scatter to the owners."""

    @staticmethod
    def forward(ctx, local, pad, cp):
        ctx.cp = cp
        ctx.n = local.shape[0]
        padded = local.new_zeros((pad, *local.shape[1:]))
        padded[: local.shape[0]] = local
        out = local.new_empty((cp.size * pad, *local.shape[1:]))
        all_gather_into(out, padded, cp.group)
        order = torch.tensor(cp.blocks, device=out.device)
        return out.view(cp.size, pad, *local.shape[1:])[order].reshape(out.shape)

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        pad = grad.shape[0] // cp.size
        blocks = grad.new_empty((cp.size, pad, *grad.shape[1:]))
        blocks[torch.tensor(cp.blocks, device=grad.device)] = grad.reshape(cp.size, pad, *grad.shape[1:])
        out = grad.new_empty((pad, *grad.shape[1:]))
        reduce_scatter_into(out, blocks.reshape(grad.shape), cp.group)
        return out[: ctx.n], None, None


def gather_kv(local: torch.Tensor, pad: int, cp: ContextParallel) -> torch.Tensor:
    """The split-document K/V rows of every CP rank, `pad` rows per rank in CP-rank order."""
    if local.shape[0] > pad:
        raise HydraulisError(f"{local.shape[0]} K/V rows do not fit the gather's {pad} rows per rank")
    return _GatherKV.apply(local, pad, cp)


def context_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ContextShard, cp: ContextParallel
) -> torch.Tensor:
    """Causal attention of this rank's queries (T, Hq, D) within their documents, over the CP group.

    Whole documents: causal SDPA on their local rows. A chunk of a split
    document: its own rows causally, merged by LSE with the gathered K/V of
    its document's earlier positions (`chunk_attention`).
    """
    if shard.cp != cp.size:
        raise HydraulisError(f"micro-batch was split for cp={shard.cp}, the group has cp={cp.size}")
    if shard.has_split:
        kernel = block_kernel(q.device, q.dtype, q.shape[-1])
        heads = k.shape[1]
        gathered = gather_kv(torch.cat([k, v], dim=1)[shard.gather_rows], shard.pad, cp)
        k_all, v_all = gathered[:, :heads], gathered[:, heads:]
    pieces = []
    for (start, end), key_rows in zip(shard.segments, shard.keys, strict=True):
        if key_rows is None:  # a whole document (or padding): causal within its local rows
            out = causal_sdpa(q[start:end], k[start:end], v[start:end])
        else:  # a chunk at global positions [a, b): its own keys causally, keys 0..a-1 in full
            out = chunk_attention(
                q[start:end], k[start:end], v[start:end], k_prefix=k_all[key_rows], v_prefix=v_all[key_rows],
                kernel=kernel,
            )
        pieces.append(out)
    if not pieces:  # a CP rank without tokens in this micro-batch (it has no split documents either)
        return torch.empty_like(q)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0].contiguous()
