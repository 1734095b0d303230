"""The sharded optimizer: AdamW on each rank's owner shard, which no deployment changes.

Rank r owns chunk r of every stripe of the global parameter vector
(layout.py), stored stripe after stripe: fp32 master weights and both AdamW
moments, whatever deployment runs, and from the reduce to the step the reduced
gradient (`OwnedGradient`). An iteration is

1. gather: every rank receives its compute shard (its replica's TP slice of
   its stage) from the owners, cast to the compute dtype;
2. forward and backward of the rank's micro-batches (pipeline/);
3. reduce: every rank sends its gradients to their owners, which sum the
   contributions of all replicas and of the CP ranks within one (the loss is already divided by the global
   batch's target tokens, so the sum is the gradient of the whole batch);
4. `step`: global-norm clipping over the owned gradients (each element is
   owned once, so nothing is counted twice) and AdamW on the owned range.

Gather and reduce run in rounds of an `ExchangePlan` (exchange_plan.py), each one
`all_to_all_single` with split sizes whose send and receive buffers each
hold at most half a bucket; at most two rounds are in flight and the owner
adds each round's contributions into its gradient as they arrive
(exchange.py runs them on this optimizer, and overlaps them with compute; this
module does not import it). A rank's transient
exchange memory is therefore O(bucket), not O(model) or O(replicas x owned).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hydraulis.errors import HydraulisError
from hydraulis.limits import DEFAULT_EXCHANGE_BUCKET_BYTES
from hydraulis.optim import AdamWSettings
from hydraulis.parallel import Deployment
from hydraulis.runtime.modeling.main_grad import ACCUMULATOR, scale_for
from hydraulis.runtime.optimizer.exchange_plan import (
    EXCHANGE_ELEMENT_BYTES,
    EXCHANGE_WINDOW,
    ExchangePlan,
    deployment_roles,
)
from hydraulis.runtime.optimizer.layout import ShardLayout

__all__ = ["EXCHANGE_WINDOW", "ShardedOptimizer", "ExchangePlan", "deployment_roles"]


class OwnedGradient:
    """The reduced gradient of a rank's owned range: fp32, or with `scaled` 2 bytes per element.

    Scaled, the sum is kept in fp16 times a power of two per block of `piece_bytes` / 4 elements (the
    scale of main_grad.py): each round's contributions are added to their blocks in fp32 and the block
    is scaled and kept again, so the sum is as accurate as fp32's for AdamW, in half the bytes of state
    that stays while the activations peak. Blocks do not depend on the deployment, so later phases of
    an iteration add to what earlier ones reduced. `pieces` yields fp32 values block by block for the
    norm and the step.

    The sum exists only from the reduce's first round to the end of the step (`release`): it is allocated
    when the first contributions arrive, by when a single-phase iteration's backward has freed the
    stage's last block, so it never meets a full set of activations (a later phase of a phased iteration
    holds it; cost/memory.py counts both).
    """

    def __init__(self, size: int, device: torch.device, scaled: bool, piece_bytes: int) -> None:
        self.scaled = scaled
        self.size = size
        self.device = device
        self.piece = max(1, piece_bytes // EXCHANGE_ELEMENT_BYTES)
        self.dtype = ACCUMULATOR if scaled else torch.float32
        self.values = torch.zeros(0, dtype=self.dtype, device=device)  # released: a sum of zero
        blocks = -(-size // self.piece) if scaled else 0
        self.inverse = torch.ones(blocks, dtype=torch.float32, device=device)  # 1 / each block's scale

    @property
    def allocated(self) -> bool:
        return len(self.values) == self.size

    def zero(self) -> None:
        """A new iteration's sum: released until its first contributions arrive."""
        self.release()

    def release(self) -> None:
        """Free the sum's storage (after the step); it reads as zero until contributions arrive."""
        self.values = torch.zeros(0, dtype=self.dtype, device=self.device)

    def allocate(self) -> None:
        """The sum's storage, zero, when the reduce's first round is issued (idempotent within an iteration)."""
        if not self.allocated:
            self.values = torch.zeros(self.size, dtype=self.dtype, device=self.device)
            self.inverse.fill_(1.0)

    def add(self, ranges: Sequence[tuple[int, int]], recv: torch.Tensor) -> None:
        """One round's contributions: (owned offset, length) of each consecutive piece of `recv`."""
        self.allocate()
        if not self.scaled:
            pos = 0
            for off, n in ranges:
                self.values[off : off + n] += recv[pos : pos + n]
                pos += n
            return
        starts = np.cumsum([0] + [n for _, n in ranges])
        touched = sorted({k for off, n in ranges for k in range(off // self.piece, (off + n - 1) // self.piece + 1)})
        for k in touched:
            a, b = k * self.piece, min((k + 1) * self.piece, len(self.values))
            block = self.values[a:b].float().mul_(self.inverse[k])
            for (off, n), pos in zip(ranges, starts[:-1], strict=True):
                lo, hi = max(off, a), min(off + n, b)
                if lo < hi:
                    block[lo - a : hi - a] += recv[pos + lo - off : pos + hi - off]
            scale, _ = scale_for(block, headroom=1.0)
            self.values[a:b].copy_(block.mul_(scale))
            self.inverse[k] = 1 / scale

    def pieces(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(start, end, fp32 values) of at most a piece: views of the sum itself in fp32, unscaled copies scaled."""
        self.allocate()
        for k, a in enumerate(range(0, len(self.values), self.piece)):
            values = self.values[a : a + self.piece]
            yield a, a + len(values), values.float().mul_(self.inverse[k]) if self.scaled else values

    def square_norm(self) -> torch.Tensor:
        """Sum of squares, reduced in fp32 (vector_norm: no temporary of the owned size)."""
        self.allocate()
        if not self.scaled:
            return torch.linalg.vector_norm(self.values).square()
        norms = torch.stack([torch.linalg.vector_norm(self.values[a : a + self.piece], dtype=torch.float32)
                             for a in range(0, len(self.values), self.piece)]) if len(self.values) else self.inverse
        return (norms * self.inverse).square().sum()


class ShardedOptimizer:
    """This rank's owned range of master weights and AdamW state, and the exchange plans of its deployments."""

    def __init__(
        self,
        layout: ShardLayout,
        rank: int,
        settings: AdamWSettings,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
        bucket_bytes: int = DEFAULT_EXCHANGE_BUCKET_BYTES,
        scaled_grad: bool = False,
    ) -> None:
        if bucket_bytes < EXCHANGE_ELEMENT_BYTES:
            raise HydraulisError(f"exchange bucket of {bucket_bytes} bytes: it must hold at least one element")
        self.layout = layout
        self.rank = rank
        self.settings = settings
        self.bucket_bytes = bucket_bytes
        self.device = torch.device(device)
        self.group = group
        n = layout.owned_size(rank)
        self.master = torch.zeros(n, dtype=torch.float32, device=self.device)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        # Under low-precision compute the reduced gradient is a scaled fp16 sum (OwnedGradient).
        self.grad = OwnedGradient(n, self.device, scaled_grad, bucket_bytes // 2)
        self.step_count = 0
        self.decay_ranges = []
        for p in layout.params:
            a, b = layout.to_local(rank, p.offset, p.offset + p.numel)
            if a < b and p.decay:
                self.decay_ranges.append((a, b))
        self._exchange_plans: dict[tuple[Deployment, bool], ExchangePlan] = {}

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's owned state: fp32 master and both AdamW moments (the live tensors) and the step count."""
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "step": self.step_count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy owned ranges of the shapes `state_dict` gives (a checkpoint resharded to this layout)."""
        for key in ("master", "exp_avg", "exp_avg_sq"):
            getattr(self, key).copy_(state[key])
        self.step_count = int(state["step"])

    def init(self, seed: int) -> None:
        self.master.copy_(self.layout.init_owned(self.rank, seed))

    def exchange_plan(self, deployment: Deployment, sequence_parallel: bool = False) -> ExchangePlan:
        """The cached exchange plan of a deployment (computed on first use, from ranges only)."""
        key = (deployment, sequence_parallel)
        if key not in self._exchange_plans:
            self._exchange_plans[key] = ExchangePlan.build(
                self.layout, deployment, self.rank, sequence_parallel, self.bucket_bytes
            )
        return self._exchange_plans[key]

    # -- step -------------------------------------------------------------------------------
    @torch.no_grad()
    def global_norm(self, extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gradient's global L2 norm; `extra` (small fp32 values) is summed over ranks in the same collective."""
        sq = self.grad.square_norm().reshape(1)
        both = sq if extra is None else torch.cat([sq, extra.float().reshape(-1).to(self.device)])
        if self.layout.world_size > 1:
            dist.all_reduce(both, group=self.group)
        return both[0].sqrt(), (None if extra is None else both[1:])

    @torch.no_grad()
    def step(self, lr: float, grad_norm: torch.Tensor, skip: bool = False) -> None:
        """Clip by the global norm (as torch's clip_grad_norm_) and take one AdamW step on the owned range
        (`skip`, a non-finite loss or norm: none); either way the reduced gradient is freed.

        Piece by piece (at most half a bucket): the temporaries (the denominator, and the fp32 values of a
        scaled gradient) never have the owned range's size.
        """
        if skip:
            self.grad.release()
            return
        s = self.settings
        coef = torch.clamp(s.grad_clip / (grad_norm + 1e-6), max=1.0) if s.grad_clip > 0 else None
        self.step_count += 1
        b1, b2 = s.betas
        if s.weight_decay:
            for a, b in self.decay_ranges:
                self.master[a:b].mul_(1 - lr * s.weight_decay)
        bias1 = 1 - b1**self.step_count
        bias2 = 1 - b2**self.step_count
        for a, b, grad in self.grad.pieces():
            if coef is not None:
                grad.mul_(coef)
            self.exp_avg[a:b].mul_(b1).add_(grad, alpha=1 - b1)
            self.exp_avg_sq[a:b].mul_(b2).addcmul_(grad, grad, value=1 - b2)
            denom = self.exp_avg_sq[a:b].sqrt().div_(math.sqrt(bias2)).add_(s.eps)
            self.master[a:b].addcdiv_(self.exp_avg[a:b], denom, value=-lr / bias1)
        self.grad.release()
