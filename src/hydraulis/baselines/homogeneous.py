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

import heapq
import time
from collections.abc import Callable

import numpy as np

from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment
from hydraulis.planner.packing import check_cap, first_fit_decreasing
from hydraulis.planner.plan import IterationPlan
from hydraulis.planner.planner import check_lengths, finalize
from hydraulis.planner.policy import PolicyContext
from hydraulis.planner.pool import fallback_config, homogeneous
from hydraulis.planner.replicas import ReplicaCost
from hydraulis.planner.schedule import Schedule


def karmarkar_karp(weights: np.ndarray, k: int, equal_size: bool = False) -> list[list[int]]:
    """k-way largest differencing: indices per part, parts of near-equal total weight.

    `equal_size` (slime's distribution of micro-batches over ranks; needs len(weights) % k == 0): the
    starting states are k consecutive items of the sorted weights, one per part, so every part ends
    with the same number of items.
    """
    if k == 1:
        return [list(range(len(weights)))]
    w = np.asarray(weights, dtype=np.float64)
    # Entry: (-(spread), tiebreak, sums descending, parts aligned with sums).
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    if equal_size:
        if len(w) % k:
            raise HydraulisError(f"equal-size partition of {len(w)} items into {k} parts")
        order = np.argsort(w, kind="stable")
        for start in range(0, len(w), k):
            items = sorted(order[start : start + k].tolist(), key=lambda i: -w[i])
            sums = [float(w[i]) for i in items]
            heap.append((-(sums[0] - sums[-1]), start, sums, [[i] for i in items]))
    else:
        for i, x in enumerate(w.tolist()):
            heap.append((-x, i, [x] + [0.0] * (k - 1), [[i]] + [[] for _ in range(k - 1)]))
    heapq.heapify(heap)
    tie = len(w)  # tiebreaks of merged states come after every starting one
    while len(heap) > 1:
        _, _, sa, pa = heapq.heappop(heap)
        _, _, sb, pb = heapq.heappop(heap)
        # Largest of one with smallest of the other.
        merged = sorted(
            ((sa[j] + sb[k - 1 - j], pa[j] + pb[k - 1 - j]) for j in range(k)), key=lambda x: x[0], reverse=True
        )
        sums = [m[0] for m in merged]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tie, sums, [m[1] for m in merged]))
        tie += 1
    return heap[0][3]


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


class Homogeneous:
    """One homogeneous deployment for the run; `assign` decides which replica runs which sequences."""

    def __init__(self, ctx: PolicyContext, name: str, deployment: Deployment | None = None) -> None:
        self.name = name
        self.ctx = ctx
        self.cost = ctx.cost
        if deployment is None:
            # packed to the cap whatever the micro-batch count: no lone micro-batches (packing.py)
            config = fallback_config(ctx.cost, ctx.cluster, ctx.run_max_length, ctx.sample, lone=False)
            deployment = homogeneous(config, ctx.cluster)
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
        return finalize(step, lengths, self.deployment, self._assign(lengths), self.ctx.cost, start)

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
