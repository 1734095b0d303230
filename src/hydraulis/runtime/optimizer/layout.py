"""The fixed, deployment-independent layout of the model's parameters (the optimizer's view).

Every parameter of the full model is flattened into ONE global vector, in the
order of the full model's parameters. The vector is cut into *stripes* of
`stripe` elements (one transformer block's worth, fixed by the model alone),
and rank r of N owns chunk r of every stripe (torch.chunk sizes, as DTensor's
Shard(0) of each stripe), its *owner shard*: fp32 master weights, AdamW moments and reduced
gradients, stored stripe after stripe in one local tensor. Every stretch of
the model is so spread over all owners (Megatron's distributed optimizer
shards each bucket over the data-parallel ranks the same way), which lets the
exchange move the model in layer order with every owner busy in every round:
the order that overlapping it with compute needs (exchange_plan.py). No deployment
changes this layout, so switching deployments moves no optimizer state.

The trick that keeps every exchange cheap is the *canonical order* of each
parameter: the dimension that tensor parallelism splits comes first. A
column-parallel weight (split along dim 0) is flattened as it is; a
row-parallel weight (split along dim 1) is flattened transposed. Then the TP
shard r of t of any parameter, for ANY degree t, is one contiguous range of
the global vector, so a rank's whole compute shard is a handful of ranges
and the exchange plan between the fixed layout and any deployment is a list
of range intersections (no per-element index).

Initialisation is defined on the canonical vector in blocks, so an owner
initialises exactly its range without ever building a full tensor.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from hydraulis.errors import HydraulisError
from hydraulis.parallel import ParallelConfig
from hydraulis.runtime.modeling.model import StageModel
from hydraulis.runtime.parallelism.tensor_parallel import ShardSpec, TensorParallel
from hydraulis.specs import ModelSpec

INIT_STD = 0.02
INIT_BLOCK = 1 << 20  # elements of one seeded init stream


def canonical_order(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`t` with its two dims swapped for a row-parallel weight (a view): the one rule of the canonical order.

    It is its own inverse: a tensor of a parameter's (full or local) shape comes out in canonical
    shape, and one of canonical shape comes out in the parameter's.
    """
    return t.t() if transposed else t


def _canonical_shape(shape: tuple[int, ...], transposed: bool) -> tuple[int, ...]:
    return tuple(reversed(shape)) if transposed else shape


@dataclass(frozen=True)
class FlatParam:
    """One parameter of the full model in the global vector."""

    name: str
    full_shape: tuple[int, ...]
    offset: int  # first element in the global vector
    transposed: bool  # canonical order is the transpose (row-parallel weights)

    @property
    def numel(self) -> int:
        return int(np.prod(self.full_shape))

    @property
    def canonical_shape(self) -> tuple[int, ...]:
        return _canonical_shape(self.full_shape, self.transposed)

    def from_canonical(self, flat: torch.Tensor) -> torch.Tensor:
        """The parameter's canonical flat vector as a full-shape tensor (contiguous)."""
        return canonical_order(flat.view(self.canonical_shape), self.transposed).contiguous()

    def to_canonical(self, full: torch.Tensor) -> torch.Tensor:
        """A full-shape tensor as its canonical flat vector (for loading full checkpoints into the layout)."""
        if tuple(full.shape) != self.full_shape:
            raise HydraulisError(f"{self.name}: shape {tuple(full.shape)} does not match the model's {self.full_shape}")
        return canonical_order(full, self.transposed).reshape(-1)

    @property
    def decay(self) -> bool:
        """Weight decay for matrices (linears, embedding), not for norm weights (nanoGPT's rule)."""
        return len(self.full_shape) >= 2

    @property
    def is_norm(self) -> bool:
        return self.name.endswith("norm.weight")


@dataclass(frozen=True)
class LocalParam:
    """One parameter of a rank's compute shard and the global ranges it exchanges."""

    name: str
    flat: FlatParam
    local_shape: tuple[int, ...]
    gather: tuple[int, int]  # global range whose values this rank computes with
    reduce: tuple[int, int]  # global range whose gradient this rank contributes (a sub-range of gather)

    @property
    def numel(self) -> int:
        return self.gather[1] - self.gather[0]

    def from_canonical(self, flat: torch.Tensor) -> torch.Tensor:
        """A canonical flat vector as a tensor of the local shape (a view)."""
        transposed = self.flat.transposed
        return canonical_order(flat.view(_canonical_shape(self.local_shape, transposed)), transposed)

    def pieces(self, t: torch.Tensor, start: int, stop: int) -> list[torch.Tensor]:
        """Views of `t` (of the local shape) covering its canonical elements [start, stop), in order (no copies).

        A row-parallel weight's canonical order is its transpose: the range is a partial row, whole rows
        and a partial row of it.
        """
        c = canonical_order(t, self.flat.transposed)
        if c.dim() < 2 or c.is_contiguous():
            return [c.view(-1)[start:stop]]
        width = c.shape[1]
        out = []
        while start < stop:
            i, j = divmod(start, width)
            if j == 0 and stop - start >= width:
                rows = (stop - start) // width
                out.append(c[i : i + rows])
                start += rows * width
            else:
                take = min(width - j, stop - start)
                out.append(c[i, j : j + take])
                start += take
        return out


@dataclass(frozen=True)
class Role:
    """What a rank computes in one deployment: its replica's config, its stage and TP rank."""

    config: ParallelConfig
    stage: int
    tp_rank: int
    sequence_parallel: bool = False


class ShardLayout:
    """The global vector of a model, its owner shards over N ranks, and each role's compute shard."""

    def __init__(self, spec: ModelSpec, world_size: int) -> None:
        if world_size < 1:
            raise HydraulisError(f"world size must be positive, got {world_size}")
        self.spec = spec
        self.world_size = world_size
        params, offset = [], 0
        for name, shape, shard in _param_shapes(spec, Role(ParallelConfig(), 0, 0)):
            flat = FlatParam(name, shape, offset, transposed=shard.dim == 1)
            params.append(flat)
            offset += flat.numel
        self.params: tuple[FlatParam, ...] = tuple(params)
        self.by_name = {p.name: p for p in self.params}
        self.total = offset
        # One transformer block's elements (the largest block of parameters, if the model has no layer), so
        # stripes follow the layers; it depends on the model only, so checkpoints reshard over world sizes.
        block = sum(p.numel for p in self.params if p.name.startswith("layers.0."))
        self.stripe = max(block or max(p.numel for p in self.params), 1)
        self.stripes = max(1, -(-offset // self.stripe))
        # Per stripe, torch.chunk sizes (ceil(len / N), the last ranks smaller or empty): DTensor's Shard(0)
        # split, so a rank's chunk of a stripe is exactly its local shard of that stripe's 1-D DTensor and
        # checkpoints reshard (checkpoints/saver.py). bounds[s, r]: global start of rank r's chunk of stripe s.
        starts = np.arange(self.stripes, dtype=np.int64) * self.stripe
        lengths = np.minimum(starts + self.stripe, offset) - starts
        chunk = -(-lengths // world_size)
        ranks = np.arange(world_size + 1, dtype=np.int64)
        self.bounds = starts[:, None] + np.minimum(chunk[:, None] * ranks[None, :], lengths[:, None])
        owned = np.diff(self.bounds, axis=1)  # [stripe, rank]
        # local_starts[s, r]: where stripe s's chunk starts in rank r's local storage
        self.local_starts = np.vstack([np.zeros((1, world_size), np.int64), np.cumsum(owned, axis=0)])

    def stripe_length(self, s: int) -> int:
        return int(self.bounds[s, -1] - self.bounds[s, 0])

    def owned_ranges(self, rank: int) -> list[tuple[int, int]]:
        """Rank's global ranges, one per stripe (some may be empty), in the order its storage holds them."""
        return [(int(a), int(b)) for a, b in zip(self.bounds[:, rank], self.bounds[:, rank + 1], strict=True)]

    def owned_size(self, rank: int) -> int:
        return int(self.local_starts[-1, rank])

    def to_local(self, rank: int, start: int, stop: int) -> tuple[int, int]:
        """Rank's local storage range holding the owned part of global [start, stop) (empty if none).

        The owned part of any global range is contiguous in local storage: it is the end of one stripe's
        chunk, whole chunks of the stripes between, and the start of the last one's.
        """
        first = self._local_position(rank, start)
        return first, max(first, self._local_position(rank, stop))

    def _local_position(self, rank: int, g: int) -> int:
        """Local index of the first owned element at or after global g."""
        s = min(max(g, 0) // self.stripe, self.stripes - 1)
        lo, hi = int(self.bounds[s, rank]), int(self.bounds[s, rank + 1])
        base = int(self.local_starts[s, rank])
        if g <= lo:
            return base
        if g < hi:
            return base + g - lo
        return int(self.local_starts[s + 1, rank])

    def assemble(self, owned: list[torch.Tensor]) -> torch.Tensor:
        """The global vector from every rank's owned storage, in rank order (single-process checks, tests)."""
        out = torch.empty(self.total, dtype=owned[0].dtype)
        for rank, local in enumerate(owned):
            for s, (a, b) in enumerate(self.owned_ranges(rank)):
                lo = int(self.local_starts[s, rank])
                out[a:b] = local[lo : lo + b - a]
        return out

    def init_owned(self, rank: int, seed: int) -> torch.Tensor:
        """Initial values of rank's owned elements in its storage order (stripe by stripe)."""
        parts = [self.init_range(a, b, seed) for a, b in self.owned_ranges(rank) if b > a]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32)

    def local_params(self, role: Role) -> tuple[LocalParam, ...]:
        """The parameters a rank of this role holds, in global order, with their gather and reduce ranges."""
        return _local_params(self.spec, role, self)

    def init_range(self, start: int, stop: int, seed: int) -> torch.Tensor:
        """Initial values of global elements [start, stop) in fp32, built block by block."""
        out = torch.empty(max(stop - start, 0), dtype=torch.float32)
        for p in self.params:
            lo, hi = max(start, p.offset), min(stop, p.offset + p.numel)
            if lo < hi:
                out[lo - start : hi - start] = init_param_range(p, lo - p.offset, hi - p.offset, seed)
        return out

    def full_state_dict(self, seed: int) -> dict[str, torch.Tensor]:
        """The whole initial model, full shapes (for single-process references and exports only)."""
        return {
            p.name: p.from_canonical(init_param_range(p, 0, p.numel, seed)) for p in self.params
        }


def init_param_range(p: FlatParam, start: int, stop: int, seed: int) -> torch.Tensor:
    """Elements [start, stop) of a parameter's canonical vector: norms 1, biases 0, else N(0, INIT_STD^2).

    Each INIT_BLOCK of the canonical vector is its own seeded stream, so a
    range is produced without generating the rest of the parameter.
    """
    if p.is_norm:
        return torch.ones(stop - start, dtype=torch.float32)
    if p.name.endswith(".bias"):  # Qwen2's q/k/v biases start at zero, as transformers initialises them
        return torch.zeros(stop - start, dtype=torch.float32)
    parts = []
    for block in range(start // INIT_BLOCK, (stop - 1) // INIT_BLOCK + 1):
        b0 = block * INIT_BLOCK
        size = min(INIT_BLOCK, p.numel - b0)
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(p.name.encode())) * 65_537 + block)
        values = torch.empty(size, dtype=torch.float32).normal_(0.0, INIT_STD, generator=g)
        parts.append(values[max(start - b0, 0) : min(stop - b0, size)])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@torch.no_grad()
def reset_parameters(model: StageModel, seed: int) -> None:
    """Deterministic init of a stage model, whatever its layout: the values the optimizer's owners start from."""
    layout = ShardLayout(model.spec, 1)
    role = Role(ParallelConfig(model.tp.size, model.num_stages, vp=model.vp), model.stage, model.tp.rank)
    named = dict(model.named_parameters())
    for lp in layout.local_params(role):
        named[lp.name].copy_(lp.from_canonical(layout.init_range(*lp.gather, seed)))


def full_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every full-model parameter of `spec`, in the global order."""
    return {p.name: p.full_shape for p in ShardLayout(spec, 1).params}


@functools.cache
def _param_shapes(spec: ModelSpec, role: Role) -> tuple[tuple[str, tuple[int, ...], ShardSpec], ...]:
    """(name, full shape, shard spec) of a role's parameters, from a model built on the meta device."""
    tp = TensorParallel.describing(role.config.tp, role.tp_rank, role.sequence_parallel)
    model = StageModel(spec, tp, role.stage, role.config.pp, device="meta", vp=role.config.vp)
    return tuple((name, layout.full_shape, layout.shard) for name, layout in model.param_layouts().items())


def _local_params(spec: ModelSpec, role: Role, layout: ShardLayout) -> tuple[LocalParam, ...]:
    tp, r = role.config.tp, role.tp_rank
    out = []
    for name, full_shape, shard in _param_shapes(spec, role):
        flat = layout.by_name[name]
        n, off = flat.numel, flat.offset
        local_shape = list(full_shape)
        if shard.dim is not None:
            local_shape[shard.dim] //= tp
            size = n // tp
            gather = (off + r * size, off + (r + 1) * size)
            reduce = gather
        else:
            gather = (off, off + n)
            if shard.partial_grad or tp == 1:
                reduce = gather  # each TP rank holds a partial gradient: the owner's sum completes it
            else:
                # Replicated with identical gradients on every TP rank: each sends 1/tp of it, so none counts twice.
                cuts = [off + k * n // tp for k in range(tp + 1)]
                reduce = (cuts[r], cuts[r + 1])
        out.append(LocalParam(name, flat, tuple(local_shape), gather, reduce))
    return tuple(sorted(out, key=lambda p: p.gather[0]))
