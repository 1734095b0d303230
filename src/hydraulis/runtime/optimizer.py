"""The disaggregated optimizer: fixed sharded AdamW state, per-deployment compute shards.

Rank r owns chunk r of every stripe of the global parameter vector
(layout.py), stored stripe after stripe: fp32 master weights, both AdamW
moments and the reduced gradient, whatever deployment runs. An iteration is

1. gather: every rank receives its compute shard (its replica's TP slice of
   its stage) from the owners, cast to the compute dtype;
2. forward and backward of the rank's micro-batches (pipeline.py);
3. reduce: every rank sends its gradients to their owners, which sum the
   contributions of all replicas and of the CP ranks within one (the loss is already divided by the global
   batch's target tokens, so the sum is the gradient of the whole batch);
4. `step`: global-norm clipping over the owned gradients (each element is
   owned once, so nothing is counted twice) and AdamW on the owned range.

Gather and reduce run in rounds of an `ExchangePlan` (exchange.py), each one
`all_to_all_single` with split sizes whose send and receive buffers each
hold at most half a bucket; at most two rounds are in flight and the owner
adds each round's contributions into its gradient as they arrive
(overlap.py, which also overlaps them with compute). A rank's transient
exchange memory is therefore O(bucket), not O(model) or O(replicas x owned).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hydraulis.cost.memory import DEFAULT_EXCHANGE_BUCKET_BYTES
from hydraulis.errors import HydraulisError
from hydraulis.optim import AdamWSettings
from hydraulis.parallel import Deployment
from hydraulis.runtime.exchange import EXCHANGE_ELEMENT_BYTES, EXCHANGE_WINDOW, ExchangePlan, deployment_roles
from hydraulis.runtime.layout import ModelLayout
from hydraulis.runtime.overlap import GatherStream, ReduceStream

DEFAULT_BUCKET_BYTES = DEFAULT_EXCHANGE_BUCKET_BYTES  # [parallel] exchange_bucket_mb's default, sized for GPUs

__all__ = ["EXCHANGE_WINDOW", "DisaggregatedOptimizer", "ExchangePlan", "deployment_roles"]


class DisaggregatedOptimizer:
    """This rank's owned range of master weights and AdamW state, and the exchanges with compute shards."""

    def __init__(
        self,
        layout: ModelLayout,
        rank: int,
        settings: AdamWSettings,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if bucket_bytes < EXCHANGE_ELEMENT_BYTES:
            raise HydraulisError(f"exchange bucket of {bucket_bytes} bytes: it must hold at least one element")
        self.layout, self.rank, self.settings = layout, rank, settings
        self.bucket_bytes = bucket_bytes
        self.exchange_peak_bytes = 0  # the largest send + receive buffers of any round so far (their real sizes)
        self.device = torch.device(device)
        self.group = group
        n = layout.owned_size(rank)
        self.master = torch.zeros(n, dtype=torch.float32, device=self.device)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.grad = torch.zeros_like(self.master)
        self.step_count = 0
        self.decay_ranges = []
        for p in layout.params:
            a, b = layout.to_local(rank, p.offset, p.offset + p.numel)
            if a < b and p.decay:
                self.decay_ranges.append((a, b))
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
        self.master.copy_(self.layout.init_owned(self.rank, seed))

    def plan(self, deployment: Deployment, sequence_parallel: bool = False) -> ExchangePlan:
        """The cached exchange plan of a deployment (computed on first use, from ranges only)."""
        key = (deployment, sequence_parallel)
        if key not in self._plans:
            self._plans[key] = ExchangePlan.build(
                self.layout, deployment, self.rank, sequence_parallel, self.bucket_bytes
            )
        return self._plans[key]

    # -- exchanges (overlap.py runs them; these are the whole exchange at once) ---------------
    def gather(self, plan: ExchangePlan, params: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
        """Fill `params` (the rank's compute shard, in plan.local order) from the owners, round by round."""
        GatherStream(self, plan, params, dtype).finish()

    def reduce(
        self, plan: ExchangePlan, grads: Sequence[torch.Tensor | None], dtype: torch.dtype = torch.float32
    ) -> None:
        """Sum every rank's gradients into the owned `self.grad`, round by round (None counts as zero).

        `grads` are the compute shard's gradients in plan.local order; they travel in `dtype` and are
        summed in fp32 as each round arrives.
        """
        ReduceStream(self, plan, grads.__getitem__, dtype).finish()

    # -- step -------------------------------------------------------------------------------
    @torch.no_grad()
    def global_norm(self, extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gradient's global L2 norm; `extra` (small fp32 values) is summed over ranks in the same collective."""
        # vector_norm reduces without a temporary of the owned size (no float64 or squared copy).
        sq = torch.linalg.vector_norm(self.grad).square().reshape(1)
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
        # The denominator in bucket-sized chunks: one temporary of at most a bucket, not of the owned range.
        chunk = max(1, self.bucket_bytes // EXCHANGE_ELEMENT_BYTES)
        for a in range(0, len(self.master), chunk):
            denom = self.exp_avg_sq[a : a + chunk].sqrt().div_(math.sqrt(bias2)).add_(s.eps)
            self.master[a : a + chunk].addcdiv_(self.exp_avg[a : a + chunk], denom, value=-lr / bias1)

