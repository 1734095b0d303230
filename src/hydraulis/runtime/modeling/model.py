"""A LLaMA-style decoder, split into pipeline stages and tensor-parallel shards.

RMSNorm, RoPE with positions that restart at each document, SwiGLU, GQA and
an output head, with the shapes of a `ModelSpec`. The families of the LLaMA
line differ by options of `spec.arch`, read here where they act: q/k/v
biases (Qwen2), RMSNorm of each q and k head (Qwen3), a head tied to the
embedding, RoPE theta and LLaMA 3's frequency scaling, the norms' eps. A
padded vocabulary (`spec.padded_vocab`) adds embedding and head rows whose
logits are -inf, so they never win and take no loss. `StageModel` is the
part one rank holds: stage s of pp holds a contiguous range of layers, the
first stage also the embedding, the last the final norm and the head; every
weight is this rank's TP shard. Interleaved (vp > 1 model chunks per rank, as
Megatron): chunk c of stage s is virtual stage c * pp + s of pp * vp, so a rank
holds vp ranges of layers, and `forward` runs one chunk. With tp = pp = 1 it is the whole model, which
the tests use as the single-device reference.

Parameter names are those of the full model (`layers.7.attn.wq.weight`)
whatever the stage, so a full state dict maps onto any layout
(`load_full_state_dict`, `full_grads`). Initial values come from the optimizer
layout (`layout.reset_parameters`), which depends on this module, not the other way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from hydraulis.cost.policies import MemoryPolicy
from hydraulis.errors import HydraulisError
from hydraulis.runtime.modeling.attention import varlen_attention
from hydraulis.runtime.modeling.context_attention import context_attention
from hydraulis.runtime.modeling.cross_entropy import head_cross_entropy
from hydraulis.runtime.modeling.fused import rms_norm, swiglu
from hydraulis.runtime.parallelism.batch import MicroBatchInput
from hydraulis.runtime.parallelism.context_parallel import ContextParallel
from hydraulis.runtime.parallelism.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    TensorParallel,
    VocabParallelEmbedding,
    enter_tp_region,
    gather_tensor,
    get_shard,
    set_shard,
    shard_tensor,
)
from hydraulis.specs import Architecture, ModelSpec


@dataclass(frozen=True)
class ParamLayout:
    """Where a local parameter sits in the full model."""

    name: str
    full_shape: tuple[int, ...]
    shard: ShardSpec


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The contiguous layers of one stage; equal counts per stage."""
    if num_layers % pp:
        raise HydraulisError(f"{num_layers} layers cannot be split evenly into {pp} pipeline stages")
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


def chunk_layers(num_layers: int, pp: int, stage: int, vp: int = 1) -> tuple[range, ...]:
    """The layers of each of a stage's vp model chunks: chunk c is virtual stage c * pp + stage of pp * vp."""
    return tuple(stage_layers(num_layers, pp * vp, c * pp + stage) for c in range(vp))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, partial_grad: bool, dtype=torch.float32, device=None, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        # Under SP each TP rank normalises only its tokens (q/k norms: only its heads): the gradient is partial.
        self.weight = set_shard(
            nn.Parameter(torch.ones(dim, dtype=dtype, device=device)), ShardSpec(partial_grad=partial_grad)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # keeps x and the rsqrt for backward only (fused.py)


def inverse_frequencies(head_dim: int, arch: Architecture, device=None) -> torch.Tensor:
    """RoPE's theta^(-2i/D) in fp64, with LLaMA 3's scaling of the low frequencies when `arch.rope_llama3`."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim
    inv = arch.rope_theta**-exponents
    if arch.rope_llama3 is None:
        return inv
    factor, low, high, original = arch.rope_llama3
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > original / low, inv / factor, inv)  # long wavelengths: divided by factor
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    positions: torch.Tensor, head_dim: int, dtype: torch.dtype, arch: Architecture = Architecture()
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (T, head_dim / 2), for per-document positions; computed once per micro-batch."""
    # fp64 angles: fp32 would lose about position * 6e-8 radians, visible on long documents.
    angles = positions.to(torch.float64).unsqueeze(-1) * inverse_frequencies(head_dim, arch, positions.device)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of x (T, H, D) by each token's angle (the LLaMA "half" layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    """GQA self-attention; query heads split over TP ranks, KV heads split or, if fewer than tp, replicated."""

    def __init__(
        self, spec: ModelSpec, tp: TensorParallel, dtype=torch.float32, device=None, cp: ContextParallel | None = None
    ):
        super().__init__()
        self.tp = tp
        self.cp = cp or ContextParallel()
        self.head_dim = spec.head_dim
        self.local_heads = tp.split(spec.heads, "attention heads")
        q_dim, kv_dim, bias = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim, spec.arch.qkv_bias
        self.wq = ColumnParallelLinear(spec.hidden, q_dim, tp, dtype, device, bias=bias)
        if spec.kv_heads % tp.size == 0:
            self.wk = ColumnParallelLinear(spec.hidden, kv_dim, tp, dtype, device, bias=bias)
            self.wv = ColumnParallelLinear(spec.hidden, kv_dim, tp, dtype, device, bias=bias)
            self.kv_rows = None
        elif tp.size % spec.kv_heads == 0:
            # More TP ranks than KV heads: every rank keeps all KV weights and uses the one
            # head its query heads share; its gradient covers only its queries (partial).
            self.wk = _ReplicatedLinear(spec.hidden, kv_dim, dtype, device, bias=bias)
            self.wv = _ReplicatedLinear(spec.hidden, kv_dim, dtype, device, bias=bias)
            head = tp.rank * spec.kv_heads // tp.size
            self.kv_rows = slice(head * spec.head_dim, (head + 1) * spec.head_dim)
        else:
            raise HydraulisError(f"kv_heads {spec.kv_heads} and tp {tp.size}: one must divide the other")
        self.wo = RowParallelLinear(q_dim, spec.hidden, tp, dtype, device)
        if spec.arch.qk_norm:  # one weight over head_dim, shared by all heads; each TP rank sees only its heads
            self.q_norm = RMSNorm(spec.head_dim, tp.size > 1, dtype, device, spec.arch.norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, tp.size > 1, dtype, device, spec.arch.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: MicroBatchInput) -> torch.Tensor:
        tokens = x.shape[0]
        if self.kv_rows is None:
            k, v = self.wk(x), self.wv(x)
        else:
            k, v = self.wk(x, self.kv_rows), self.wv(x, self.kv_rows)
        q = self.wq(x).view(tokens, self.local_heads, self.head_dim)
        # explicit head counts, not -1: a CP rank may hold no tokens of a tiny micro-batch
        k = k.view(tokens, k.shape[-1] // self.head_dim, self.head_dim)
        v = v.view(tokens, v.shape[-1] // self.head_dim, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if batch.context is not None:
            out = context_attention(q, k, v, batch.context, self.cp)
        else:
            out = varlen_attention(q, k, v, batch.cu_seqlens, batch.max_seqlen)
        return self.wo(out.reshape(tokens, self.local_heads * self.head_dim))


class _ReplicatedLinear(nn.Module):
    """K or V with fewer heads than TP ranks: all of it on every rank, applied to the rows of one head."""

    def __init__(self, in_features: int, out_features: int, dtype=torch.float32, device=None, bias: bool = False):
        super().__init__()
        weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
        if not weight.is_meta:  # as in tensor_parallel._init_weight
            nn.init.normal_(weight, std=1.0 / math.sqrt(in_features))
        self.weight = set_shard(nn.Parameter(weight), ShardSpec(partial_grad=True))
        zeros = torch.zeros(out_features, dtype=dtype, device=device)
        self.bias = set_shard(nn.Parameter(zeros), ShardSpec(partial_grad=True)) if bias else None

    def forward(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        return F.linear(x, self.weight[rows], None if self.bias is None else self.bias[rows])


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 and w3 column-parallel, w2 row-parallel."""

    def __init__(self, spec: ModelSpec, tp: TensorParallel, dtype=torch.float32, device=None):
        super().__init__()
        self.w1 = ColumnParallelLinear(spec.hidden, spec.ffn, tp, dtype, device)
        self.w3 = ColumnParallelLinear(spec.hidden, spec.ffn, tp, dtype, device)
        self.w2 = RowParallelLinear(spec.ffn, spec.hidden, tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))  # keeps the two projections only (fused.py)


class Block(nn.Module):
    def __init__(
        self, spec: ModelSpec, tp: TensorParallel, dtype=torch.float32, device=None, cp: ContextParallel | None = None
    ):
        super().__init__()
        self.tp = tp
        eps = spec.arch.norm_eps
        self.attn_norm = RMSNorm(spec.hidden, tp.sequence_parallel, dtype, device, eps)
        self.attn = Attention(spec, tp, dtype, device, cp)
        self.ffn_norm = RMSNorm(spec.hidden, tp.sequence_parallel, dtype, device, eps)
        self.ffn = FeedForward(spec, tp, dtype, device)

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: MicroBatchInput, selective: bool = False
    ) -> torch.Tensor:
        """`selective`: checkpoint the MLP (cost/policies.py), keeping its input and running it again in backward."""
        h = h + self.attn(enter_tp_region(self.attn_norm(h), self.tp), rope, batch)
        if selective and torch.is_grad_enabled():
            return h + torch.utils.checkpoint.checkpoint(self._mlp, h, use_reentrant=False)
        return h + self._mlp(h)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.ffn(enter_tp_region(self.ffn_norm(h), self.tp))


class StageModel(nn.Module):
    """The layers, embedding and head that one rank holds, as TP shards.

    forward(x, batch): x is the token ids (first stage) or the previous stage's
    hidden states; returns hidden states (T or T / tp under SP, hidden) or, on
    the last stage, this rank's vocab shard of the logits (T, vocab_rows / tp).

    A tied head multiplies by the embedding's weight. When the last stage is
    not the first it holds its own copy under the same name
    (`embedding.weight`), so its owner shard sums the two stages'
    gradients into one master tensor, as it sums replicas'.
    """

    def __init__(
        self,
        spec: ModelSpec,
        tp: TensorParallel = TensorParallel(),
        stage: int = 0,
        num_stages: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        cp: ContextParallel | None = None,
        vp: int = 1,
    ):
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.stage = stage
        self.num_stages = num_stages
        self.vp = vp
        # Context parallelism: this rank holds only its CP rank's tokens; attention gathers K/V over the group.
        self.cp = cp or ContextParallel()
        # Each micro-batch's own memory policy (`MicroBatchInput.policy`, cost/policies.py; the recompute set's
        # configs get full from `CostModel.policy_run`): full keeps only each block's input and runs its forward
        # again in backward, selective does so for each block's MLP.
        self.chunks = chunk_layers(spec.layers, num_stages, stage, vp)
        tied = spec.arch.tied_embeddings
        has_embedding = self.is_first or (tied and self.is_last)
        rows = spec.vocab_rows
        self.embedding = VocabParallelEmbedding(rows, spec.hidden, tp, dtype, device) if has_embedding else None
        layers = [i for chunk in self.chunks for i in chunk]
        self.layers = nn.ModuleDict({str(i): Block(spec, tp, dtype, device, self.cp) for i in layers})
        self.norm = self.output = None
        if self.is_last:
            self.norm = RMSNorm(spec.hidden, tp.sequence_parallel, dtype, device, spec.arch.norm_eps)
            if not tied:
                self.output = ColumnParallelLinear(spec.hidden, rows, tp, dtype, device)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def vocab_start(self) -> int:
        """First vocabulary id of this rank's logits shard."""
        return self.tp.rank * (self.spec.vocab_rows // self.tp.size)

    @property
    def head_weight(self) -> torch.Tensor:
        """The head's vocab shard (the embedding's when tied)."""
        return self.embedding.weight if self.output is None else self.output.weight

    @property
    def valid_vocab(self) -> int:
        """Rows of this rank's head shard that are real vocabulary; the rest are padding (logits -inf)."""
        rows = self.spec.vocab_rows // self.tp.size
        return max(0, min(rows, self.spec.vocab - self.vocab_start))

    def has_head(self, chunk: int) -> bool:
        """Whether `chunk` is the model's last virtual stage: the one with the final norm and the head."""
        return self.is_last and chunk == self.vp - 1

    def _trunk(self, x: torch.Tensor, batch: MicroBatchInput, chunk: int) -> torch.Tensor:
        """The chunk's layers; on the last stage also the final norm, entered into the TP region for the head."""
        h = self.embedding(x) if self.is_first and chunk == 0 else x
        rope = rope_tables(batch.positions, self.spec.head_dim, h.dtype, self.spec.arch)
        full = batch.policy == MemoryPolicy.FULL
        for layer in (self.layers[str(i)] for i in self.chunks[chunk]):
            if full and torch.is_grad_enabled():
                h = torch.utils.checkpoint.checkpoint(layer, h, rope, batch, use_reentrant=False)
            else:
                h = layer(h, rope, batch, batch.policy == MemoryPolicy.SELECTIVE)
        return enter_tp_region(self.norm(h), self.tp) if self.has_head(chunk) else h

    def forward(self, x: torch.Tensor, batch: MicroBatchInput, chunk: int = 0) -> torch.Tensor:
        """Model chunk `chunk` (the only one unless interleaved) on token ids or the previous chunk's output."""
        h = self._trunk(x, batch, chunk)
        if not self.has_head(chunk):
            return h
        logits = F.linear(h, self.head_weight)
        if self.valid_vocab < logits.shape[-1]:
            keep = torch.arange(logits.shape[-1], device=logits.device) < self.valid_vocab
            logits = logits.masked_fill(~keep, float("-inf"))
        return logits

    def loss_sum(self, x: torch.Tensor, batch: MicroBatchInput) -> torch.Tensor:
        """The last stage's sum of token losses (fp32 scalar), its logits computed chunk by chunk and never kept
        (cross_entropy.py); training uses this, `forward` gives the logits themselves."""
        if not self.is_last:
            raise HydraulisError(f"stage {self.stage} of {self.num_stages} has no head")
        h = self._trunk(x, batch, self.vp - 1)
        return head_cross_entropy(h, self.head_weight, batch.targets, vocab_start=self.vocab_start,
                                  valid=self.valid_vocab, tp=self.tp)

    # ------------------------------------------------------------ layouts

    def param_layouts(self) -> dict[str, ParamLayout]:
        layouts = {}
        for name, p in self.named_parameters():
            shard = get_shard(p)
            full = list(p.shape)
            if shard.dim is not None:
                full[shard.dim] *= self.tp.size
            layouts[name] = ParamLayout(name, tuple(full), shard)
        return layouts

    @torch.no_grad()
    def load_full_state_dict(self, full: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's shards out of full-model tensors (extra names, e.g. other stages', are ignored)."""
        for name, p in self.named_parameters():
            if name not in full:
                raise HydraulisError(f"full state dict has no {name!r}")
            local = shard_tensor(full[name], get_shard(p), self.tp)
            if tuple(local.shape) != tuple(p.shape):
                raise HydraulisError(
                    f"{name}: full shape {tuple(full[name].shape)} does not fit shard {tuple(p.shape)}"
                )
            p.copy_(local)

    def _partial_params(self) -> list[nn.Parameter]:
        """Parameters whose gradient on this rank is only a share: all of them under CP (each rank's tokens)."""
        if self.cp.size > 1:
            return list(self.parameters())
        if self.tp.size == 1:
            return []
        return [p for p in self.parameters() if get_shard(p).partial_grad]

    def stash_partial_grads(self) -> list[torch.Tensor | None]:
        """Set aside the already-summed gradients of partial-gradient parameters (before a step's backward)."""
        stashed = []
        for p in self._partial_params():
            stashed.append(p.grad)
            p.grad = None
        return stashed

    def finish_grads(self, stashed: list[torch.Tensor | None] | None = None) -> None:
        """Sum this step's partial gradients over the TP group (and all over the CP group), then add back the stash.

        Stashing keeps gradient accumulation over several steps exact: an
        earlier step's gradients, already summed, are not summed again.
        """
        params = self._partial_params()
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if self.tp.size > 1:
            tp_partial = [i for i, p in enumerate(params) if get_shard(p).partial_grad]
            if tp_partial:
                reduced = _all_reduce_flat([grads[i] for i in tp_partial], self.tp.group)
                for i, g in zip(tp_partial, reduced, strict=True):
                    grads[i] = g
        if self.cp.size > 1:
            grads = _all_reduce_flat(grads, self.cp.group)
        for i, p in enumerate(params):
            summed = grads[i]
            if stashed is not None and stashed[i] is not None:
                summed = summed + stashed[i]
            p.grad = summed.clone()

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Gradients in full shape (a collective over the TP group), keyed by full-model name."""
        return {
            name: gather_tensor(p.grad, get_shard(p), self.tp)
            for name, p in self.named_parameters()
            if p.grad is not None
        }


def _all_reduce_flat(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Sum tensors over a process group in one all-reduce of their concatenation; views in their shapes."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    torch.distributed.all_reduce(flat, group=group)
    return [part.view_as(t) for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True)]
