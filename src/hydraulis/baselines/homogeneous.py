"""Homogeneous baselines (docs/design.md, section 5): one config for the whole run, replicated over all GPUs.

The config is the cheapest that holds the run's longest sequence (the same
choice as the planner's fallback). On a cost model with CP configs (`+cp`)
that may be a CP config: megatron is then static CP, every replica the same
(tp, pp, cp), documents packed by tokens.

- megatron: pack greedily in data order to the token cap, spread the
  micro-batches over replicas by count.
- token-balanced: Karmarkar-Karp on tokens across replicas, token-capped packing.
- flops-balanced: Karmarkar-Karp on a*s^2 + b*s across replicas, token-capped packing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from hydraulis.errors import HydraulisError
from hydraulis.limits import check_lengths
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.dispatch import karmarkar_karp
from hydraulis.planner.packing import check_cap, first_fit_decreasing
from hydraulis.planner.plan import IterationPlan
from hydraulis.planner.planner import finalize
from hydraulis.planner.policy import PolicyContext
from hydraulis.planner.pool import fallback_config, homogeneous
from hydraulis.planner.replicas import ReplicaCost
from hydraulis.planner.schedule import Schedule


def data_order_packing(lengths: np.ndarray, cap: int) -> list[list[int]]:
    """Fill micro-batches in data order; start a new one when the next sequence would overflow."""
    check_cap(lengths, cap)
    out: list[list[int]] = []
    room = -1
    for i, s in enumerate(lengths.tolist()):
        if s > room:
            out.append([])
            room = cap
        out[-1].append(i)
        room -= s
    return out


def recipe_interleaving(ctx: PolicyContext, config: ParallelConfig, longest: int) -> ParallelConfig:
    """`config` with the interleaving its users run (`ParallelConfig.vp_choices`, the largest whose cap still holds
    the run's `longest` sequence, as they would shrink it before the run ran out of memory); itself without. Off
    where the context says so (`PolicyContext.interleave`: the bench's before-and-after)."""
    return next((g for g in interleavings(ctx, config) if ctx.cost.cap(g, ctx.num_gpus) >= longest), config)


def interleavings(ctx: PolicyContext, config: ParallelConfig) -> list[ParallelConfig]:
    """`config` with each vp of `ParallelConfig.vp_choices` whose cap holds anything, largest vp first; none where
    `PolicyContext.interleave` is off."""
    if not ctx.interleave:
        return []
    held = (config.interleaved(v) for v in config.vp_choices(ctx.cost.model))
    return [g for g in held if ctx.cost.cap(g, ctx.num_gpus) > 0]


class Homogeneous:
    """One homogeneous deployment for the run; `assign` decides which replica runs which sequences."""

    def __init__(self, ctx: PolicyContext, name: str, deployment: Deployment | None = None) -> None:
        self.name = name
        self.ctx = ctx
        self.cost = ctx.cost
        if deployment is None:
            # packed to the cap whatever the micro-batch count: no lone micro-batches (packing.py)
            config = fallback_config(ctx.cost, ctx.cluster, ctx.run_max_length, ctx.sample, lone=False)
            deployment = homogeneous(recipe_interleaving(ctx, config, ctx.run_max_length), ctx.cluster)
        self.deployment = deployment
        self.replica = ReplicaCost.of(ctx.cost, deployment.configs[0], ctx.num_gpus)
        assigners: dict[str, Callable[[np.ndarray], list[list[list[int]]]]] = {
            "megatron": self._megatron,
            "token-balanced": lambda s: self._balanced(s, s.astype(np.float64)),
            "flops-balanced": lambda s: self._balanced(s, self.replica.seq_costs(s)),
        }
        self._assign = assigners[name]

    @classmethod
    def on(cls, ctx: PolicyContext, deployment: Deployment, name: str) -> Homogeneous:
        """The same assignment on a given homogeneous deployment (hotspa's phases)."""
        return cls(ctx, name, deployment)

    def plan(self, lengths: np.ndarray, step: int = 0) -> IterationPlan:
        start = time.perf_counter()
        lengths = check_lengths(lengths)
        longest, cap = int(lengths.max()), self.replica.cap
        if longest > cap:
            raise HydraulisError(
                f"{self.name}: a sequence of {longest} tokens is longer than the cap of its deployment "
                f"{self.deployment} ({cap} tokens; the run's longest sequence was given as {self.ctx.run_max_length})"
            )
        return finalize(
            step, lengths, self.deployment, micro_batches=self._assign(lengths), cost=self.ctx.cost, started=start
        )

    def schedule(self, lengths: np.ndarray, step: int = 0) -> Schedule:
        return Schedule.single(self.plan(lengths, step))

    def _megatron(self, lengths: np.ndarray) -> list[list[list[int]]]:
        mbs = data_order_packing(lengths, self.replica.cap)
        chunks = np.array_split(np.arange(len(mbs)), len(self.deployment))
        return [[mbs[j] for j in chunk.tolist()] for chunk in chunks]

    def _balanced(self, lengths: np.ndarray, weights: np.ndarray) -> list[list[list[int]]]:
        out = []
        for part in karmarkar_karp(weights, len(self.deployment)):
            idx = np.array(part, dtype=np.int64)
            out.append([idx[b].tolist() for b in first_fit_decreasing(lengths[idx], self.replica.cap)] if part else [])
        return out
