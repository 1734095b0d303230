"""The disaggregated optimizer: fixed sharded AdamW state, per-deployment compute shards.

Rank r owns range r of the global parameter vector (layout.py): fp32 master
weights, both AdamW moments and the reduced gradient, whatever deployment
runs. An iteration is

1. `gather`: every rank receives its compute shard (its replica's TP slice of
   its stage) from the owners, cast to the compute dtype;
2. forward and backward of the rank's micro-batches (pipeline.py);
3. `reduce`: every rank sends its gradients to their owners, which sum the
   contributions of all replicas and of the CP ranks within one (the loss is already divided by the global
   batch's target tokens, so the sum is the gradient of the whole batch);
4. `step`: global-norm clipping over the owned gradients (each element is
   owned once, so nothing is counted twice) and AdamW on the owned range.

Each of `gather` and `reduce` is ONE `all_to_all_single` with split sizes
(gloo and NCCL both have it), driven by an `ExchangePlan` that is computed
once per deployment from range intersections and cached. A rank sends and
receives only the elements of its own shards, and never builds a full-model
tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hydraulis.cost.memory import TrainingState
from hydraulis.errors import HydraulisError
from hydraulis.optim import AdamWSettings
from hydraulis.parallel import Deployment
from hydraulis.runtime.groups import rank_roles
from hydraulis.runtime.layout import LocalParam, ModelLayout, Role


def deployment_roles(deployment: Deployment, sequence_parallel: bool = False) -> dict[int, Role]:
    """Every global rank's role in a deployment (ranks are stage-major within a replica, as groups.py builds them).

    The CP ranks of a TP rank share its role: the same parameter shard, each
    with the gradient of its own tokens, which the owners sum as they sum replicas.
    """
    roles = {}
    for replica in deployment.replicas:
        config = replica.config
        for rank, (stage, _, tp_rank) in rank_roles(config, replica.devices).items():
            roles[rank] = Role(config, stage, tp_rank, sequence_parallel and config.tp > 1)
    return roles


def _clip(ranges: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """(k, 2) ranges intersected with [lo, hi), empty ones dropped."""
    if len(ranges) == 0:
        return ranges
    out = np.stack([np.maximum(ranges[:, 0], lo), np.minimum(ranges[:, 1], hi)], axis=1)
    return out[out[:, 1] > out[:, 0]]


@dataclass(frozen=True)
class ExchangePlan:
    """One rank's side of the gather and the reduce for one deployment (element counts, not bytes).

    gather_send: (start, length) slices of this rank's owned range, destination by destination;
    gather_recv_splits / gather_send_splits: all_to_all_single split sizes per peer.
    reduce_*: the reverse direction; reduce_recv pieces are (buffer position, owned offset, length).
    """

    rank: int
    local: tuple[LocalParam, ...]
    gather_send: tuple[tuple[int, int], ...]
    gather_send_splits: tuple[int, ...]
    gather_recv_splits: tuple[int, ...]
    reduce_send_splits: tuple[int, ...]
    reduce_recv_splits: tuple[int, ...]
    reduce_recv: tuple[tuple[int, int, int], ...]

    @classmethod
    def build(cls, layout: ModelLayout, deployment: Deployment, rank: int, sequence_parallel: bool = False):
        roles = deployment_roles(deployment, sequence_parallel)
        world = layout.world_size
        if sorted(roles) != list(range(world)):
            raise HydraulisError(f"deployment {deployment} covers ranks {sorted(roles)}, the job has {world}")
        lo, hi = layout.owner_range(rank)
        local = layout.local_params(roles[rank])
        gathers = {r: np.array([p.gather for p in layout.local_params(roles[r])], np.int64).reshape(-1, 2)
                   for r in range(world)}
        reduces = {r: np.array([p.reduce for p in layout.local_params(roles[r])], np.int64).reshape(-1, 2)
                   for r in range(world)}
        gather_send, send_splits = [], []
        reduce_recv, recv_splits, pos = [], [], 0
        for r in range(world):
            mine = _clip(gathers[r], lo, hi)
            gather_send.extend((int(a) - lo, int(b - a)) for a, b in mine)
            send_splits.append(int((mine[:, 1] - mine[:, 0]).sum()))
            theirs = _clip(reduces[r], lo, hi)
            for a, b in theirs:
                reduce_recv.append((pos, int(a) - lo, int(b - a)))
                pos += int(b - a)
            recv_splits.append(int((theirs[:, 1] - theirs[:, 0]).sum()))
        own = [layout.owner_range(o) for o in range(world)]
        g_recv = [int((lambda c: (c[:, 1] - c[:, 0]).sum())(_clip(gathers[rank], a, b))) for a, b in own]
        r_send = [int((lambda c: (c[:, 1] - c[:, 0]).sum())(_clip(reduces[rank], a, b))) for a, b in own]
        return cls(
            rank=rank,
            local=local,
            gather_send=tuple(gather_send),
            gather_send_splits=tuple(send_splits),
            gather_recv_splits=tuple(g_recv),
            reduce_send_splits=tuple(r_send),
            reduce_recv_splits=tuple(recv_splits),
            reduce_recv=tuple(reduce_recv),
        )

    def traffic(self) -> dict[str, int]:
        """Elements this rank sends and receives over the network (its own range to itself excluded)."""
        me = self.rank

        def off_self(splits: tuple[int, ...]) -> int:
            return sum(splits) - splits[me]

        return {
            "gather_send": off_self(self.gather_send_splits),
            "gather_recv": off_self(self.gather_recv_splits),
            "reduce_send": off_self(self.reduce_send_splits),
            "reduce_recv": off_self(self.reduce_recv_splits),
        }


class DisaggregatedOptimizer:
    """This rank's owned range of master weights and AdamW state, and the exchanges with compute shards."""

    def __init__(
        self,
        layout: ModelLayout,
        rank: int,
        settings: AdamWSettings,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.layout, self.rank, self.settings = layout, rank, settings
        self.device = torch.device(device)
        self.group = group
        self.lo, self.hi = layout.owner_range(rank)
        n = self.hi - self.lo
        self.master = torch.zeros(n, dtype=torch.float32, device=self.device)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.grad = torch.zeros_like(self.master)
        self.step_count = 0
        self.decay_ranges = []
        for p in layout.params:
            a, b = max(self.lo, p.offset), min(self.hi, p.offset + p.numel)
            if a < b and p.decay:
                self.decay_ranges.append((a - self.lo, b - self.lo))
        self._plans: dict[tuple[Deployment, bool], ExchangePlan] = {}

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
        self.master.copy_(self.layout.init_range(self.lo, self.hi, seed))

    def plan(self, deployment: Deployment, sequence_parallel: bool = False) -> ExchangePlan:
        """The cached exchange plan of a deployment (computed on first use, from ranges only)."""
        key = (deployment, sequence_parallel)
        if key not in self._plans:
            self._plans[key] = ExchangePlan.build(self.layout, deployment, self.rank, sequence_parallel)
        return self._plans[key]

    def state_bytes(self, compute: Sequence[torch.Tensor] = ()) -> dict[str, int]:
        """Bytes this rank really holds: owned state, plus the compute shard's parameters and gradients."""
        owned = sum(t.numel() * t.element_size() for t in (self.master, self.exp_avg, self.exp_avg_sq, self.grad))
        params = sum(p.numel() * p.element_size() for p in compute)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in compute if p.grad is not None)
        return {"owned": owned, "params": params, "grads": grads}

    # -- exchanges ------------------------------------------------------------------------------
    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits) -> None:
        if self.layout.world_size == 1:
            out.copy_(inp)
            return
        dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=self.group)

    @torch.no_grad()
    def gather(self, plan: ExchangePlan, params: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
        """Fill `params` (the rank's compute shard, in plan.local order) from the owners."""
        if len(params) != len(plan.local):
            raise HydraulisError(f"gather: {len(params)} parameters, the exchange plan has {len(plan.local)}")
        slices = [self.master[a : a + n] for a, n in plan.gather_send]
        send = (torch.cat(slices) if slices else self.master[:0]).to(dtype)
        recv = torch.empty(sum(plan.gather_recv_splits), dtype=dtype, device=self.device)
        self._all_to_all(recv, send, plan.gather_recv_splits, plan.gather_send_splits)
        pos = 0
        for p, lp in zip(params, plan.local, strict=True):
            p.copy_(lp.from_canonical(recv[pos : pos + lp.numel]))
            pos += lp.numel

    @torch.no_grad()
    def reduce(self, plan: ExchangePlan, params: Sequence[torch.Tensor]) -> None:
        """Sum every rank's gradients into the owned `self.grad` (missing .grad counts as zero)."""
        pieces = []
        for p, lp in zip(params, plan.local, strict=True):
            a = lp.reduce[0] - lp.gather[0]
            n = lp.reduce[1] - lp.reduce[0]
            if p.grad is None:
                pieces.append(torch.zeros(n, dtype=torch.float32, device=self.device))
            else:
                pieces.append(lp.to_canonical(p.grad)[a : a + n].float())
        send = torch.cat(pieces) if pieces else self.grad[:0]
        recv = torch.empty(sum(plan.reduce_recv_splits), dtype=torch.float32, device=self.device)
        self._all_to_all(recv, send, plan.reduce_recv_splits, plan.reduce_send_splits)
        self.grad.zero_()
        for pos, off, n in plan.reduce_recv:
            self.grad[off : off + n] += recv[pos : pos + n]

    # -- step -------------------------------------------------------------------------------
    @torch.no_grad()
    def global_norm(self, extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gradient's global L2 norm; `extra` (small fp32 values) is summed over ranks in the same collective."""
        sq = self.grad.double().square().sum().float().reshape(1)
        both = sq if extra is None else torch.cat([sq, extra.float().reshape(-1).to(self.device)])
        if self.layout.world_size > 1:
            dist.all_reduce(both, group=self.group)
        return both[0].sqrt(), (None if extra is None else both[1:])

    @torch.no_grad()
    def step(self, lr: float, grad_norm: torch.Tensor) -> None:
        """Clip by the global norm (as torch's clip_grad_norm_) and take one AdamW step on the owned range."""
        s = self.settings
        if s.grad_clip > 0:
            coef = torch.clamp(s.grad_clip / (grad_norm + 1e-6), max=1.0)
            self.grad.mul_(coef)
        self.step_count += 1
        b1, b2 = s.betas
        if s.weight_decay:
            for a, b in self.decay_ranges:
                self.master[a:b].mul_(1 - lr * s.weight_decay)
        self.exp_avg.mul_(b1).add_(self.grad, alpha=1 - b1)
        self.exp_avg_sq.mul_(b2).addcmul_(self.grad, self.grad, value=1 - b2)
        bias1 = 1 - b1**self.step_count
        bias2 = 1 - b2**self.step_count
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(s.eps)
        self.master.addcdiv_(self.exp_avg, denom, value=-lr / bias1)


def state_bytes_formula(layout: ModelLayout, local: Sequence[LocalParam], rank: int, dtype_bytes: int) -> dict:
    """What the memory model says this rank holds (cost.model.TrainingState), to compare with `state_bytes`."""
    state = TrainingState(param_bytes=dtype_bytes, grad_bytes=dtype_bytes)
    lo, hi = layout.owner_range(rank)
    shard = sum(p.numel for p in local)
    return {"owned": (hi - lo) * state.sharded_bytes, "params": shard * state.param_bytes,
            "grads": shard * state.grad_bytes}
