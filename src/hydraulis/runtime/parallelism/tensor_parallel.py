"""Megatron-style tensor parallelism, with optional sequence parallelism.

A block's column-parallel linears split their output features (attention
heads, FFN columns) over the TP ranks, and its row-parallel linear splits its
input features and sums the partial outputs. Between the two, no
communication; around them, two conjugate operators:

- `enter_tp_region` ("f"): identity forward, all-reduce backward; with
  sequence parallelism an all-gather of the token dimension forward and a
  reduce-scatter backward. A block calls it ONCE for its several column
  linears (Q, K, V or gate, up), so their input gradients are summed locally
  and reduced once.
- `exit_tp_region` ("g"): all-reduce forward, identity backward; with
  sequence parallelism a reduce-scatter forward and an all-gather backward.

With sequence parallelism the activations between blocks (residual stream,
norms) are split over TP ranks along tokens, which divides their memory by
tp; the norm weights then see only their rank's tokens, so their gradients
are partial and are summed over the TP group after backward (`ShardSpec.
partial_grad`).

Embedding and head are vocab-parallel; the loss (cross_entropy.py) takes
the head's vocab shard and never gathers full logits.

Every parameter carries a `ShardSpec` that says how its local tensor relates
to the full one, so a layout change (the next runtime issue) and the tests
can move between full and sharded tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hydraulis.errors import HydraulisError
from hydraulis.runtime.parallelism.collectives import all_gather_into, all_reduce, reduce_scatter_into
from hydraulis.runtime.parallelism.weight_grad import linear

SHARD_ATTR = "hydraulis_shard"


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its TP group; size 1 (group None) makes every operator an identity."""

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    sequence_parallel: bool = False
    describe_only: bool = False  # shapes only (meta models for exchange plans); its collectives never run

    def __post_init__(self) -> None:
        if self.size > 1 and self.group is None and not self.describe_only:
            raise HydraulisError(f"tensor parallel size {self.size} needs a process group")
        if not 0 <= self.rank < self.size:
            raise HydraulisError(f"tensor parallel rank {self.rank} is outside 0..{self.size - 1}")

    @classmethod
    def describing(cls, size: int, rank: int, sequence_parallel: bool = False) -> TensorParallel:
        """A TP rank of another process, for building shapes on the meta device without its group."""
        return cls(size, rank, None, sequence_parallel and size > 1, describe_only=True)

    def split(self, n: int, what: str) -> int:
        """This rank's share of n (features, heads, vocab); n must divide evenly."""
        if n % self.size:
            raise HydraulisError(f"{what} = {n} is not divisible by tensor parallel size {self.size}")
        return n // self.size


@dataclass(frozen=True)
class ShardSpec:
    """How a local parameter relates to the full one.

    dim: the dimension split evenly over TP ranks (rank r holds chunk r), or
    None when every rank holds the full tensor. partial_grad: replicated, but
    each rank's gradient is only its share, so the TP group sums them.
    """

    dim: int | None = None
    partial_grad: bool = False


def set_shard(param: nn.Parameter, spec: ShardSpec) -> nn.Parameter:
    setattr(param, SHARD_ATTR, spec)
    return param


def get_shard(param: torch.Tensor) -> ShardSpec:
    return getattr(param, SHARD_ATTR, ShardSpec())


def shard_tensor(full: torch.Tensor, spec: ShardSpec, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of a full tensor."""
    if spec.dim is None or tp.size == 1:
        return full
    return full.chunk(tp.size, dim=spec.dim)[tp.rank]


def gather_tensor(local: torch.Tensor, spec: ShardSpec, tp: TensorParallel) -> torch.Tensor:
    """The full tensor from every rank's part (a collective over the TP group when sharded)."""
    if spec.dim is None or tp.size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(parts, local.contiguous(), group=tp.group)
    return torch.cat(parts, dim=spec.dim)


# ---------------------------------------------------------------- communication


def _all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return all_reduce(x.contiguous(), tp.group)


def _all_gather_tokens(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    out = torch.empty((x.shape[0] * tp.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return all_gather_into(out, x, tp.group)


def _reduce_scatter_tokens(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if x.shape[0] % tp.size:
        raise HydraulisError(
            f"sequence parallelism: {x.shape[0]} tokens are not divisible by tp={tp.size}; "
            "pack micro-batches with pad_to_multiple=tp"
        )
    out = torch.empty((x.shape[0] // tp.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return reduce_scatter_into(out, x, tp.group)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x.clone(), tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _all_gather_tokens(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_tokens(grad, ctx.tp), None


class _ReduceScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _reduce_scatter_tokens(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_tokens(grad, ctx.tp), None


def enter_tp_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Input of column-parallel linears: full tokens on every rank ("f")."""
    if tp.size == 1:
        return x
    return _GatherTokens.apply(x, tp) if tp.sequence_parallel else _CopyToRegion.apply(x, tp)


def exit_tp_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum of the partial outputs of a row-parallel layer ("g"); token-split under SP."""
    if tp.size == 1:
        return x
    return _ReduceScatterTokens.apply(x, tp) if tp.sequence_parallel else _ReduceFromRegion.apply(x, tp)


# ---------------------------------------------------------------- layers


def _init_weight(out_features: int, in_features: int, dtype: torch.dtype, device: torch.device | str | None):
    weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
    if not weight.is_meta:  # on meta (shapes only) a random init runs torch's Python refs: 1.5 s of imports
        nn.init.normal_(weight, std=1.0 / math.sqrt(in_features))
    return nn.Parameter(weight)


class ColumnParallelLinear(nn.Module):
    """y[:, shard] = x W[shard]^T: output features split over TP ranks, input full.

    The caller enters the TP region once (`enter_tp_region`) for all column
    linears that share an input.
    """

    def __init__(
        self, in_features: int, out_features: int, tp: TensorParallel, dtype=torch.float32, device=None,
        bias: bool = False,
    ):  # fmt: skip
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        local = tp.split(out_features, "output features")
        self.weight = set_shard(_init_weight(local, in_features, dtype, device), ShardSpec(dim=0))
        # A bias splits with the output features (Qwen2's q, k, v).
        zeros = torch.zeros(local, dtype=dtype, device=device)
        self.bias = set_shard(nn.Parameter(zeros), ShardSpec(dim=0)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)  # its weight gradient may wait (weight_grad.py)


class RowParallelLinear(nn.Module):
    """y = sum_r x[:, shard_r] W[:, shard_r]^T: input features split, outputs summed over TP ranks."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, dtype=torch.float32, device=None):
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.weight = set_shard(
            _init_weight(out_features, tp.split(in_features, "input features"), dtype, device), ShardSpec(dim=1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exit_tp_region(linear(x, self.weight), self.tp)


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split over TP ranks; each rank embeds the tokens it owns, the group sums."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel, dtype=torch.float32, device=None):
        super().__init__()
        self.tp = tp
        local = tp.split(vocab, "vocab")
        self.vocab_start = tp.rank * local
        factory = torch.empty if torch.device(device or "cpu").type == "meta" else torch.randn  # as in _init_weight
        self.weight = set_shard(nn.Parameter(factory(local, hidden, dtype=dtype, device=device)), ShardSpec(dim=0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_tp_region(out, self.tp)
