"""slime-flops: slime's `--balance-by-flops` (docs/design.md, section 5).

slime (THUDM/slime, slime/utils/dp_schedule.py, seqlen_balancing.py,
flops_utils.py) packs first and distributes second, on one homogeneous config:

1. the step's sequences go into K = ceil(tokens / (max_tokens_per_gpu x cp))
   micro-batches (one each if K reaches the count) by Karmarkar-Karp on each
   sequence's forward FLOPs, coeff x L + L^2 from the model's shape
   (`forward_flops`); the token budget sets only K, it is not enforced per
   micro-batch;
2. K is raised to a multiple of the data-parallel size by splitting the
   micro-batch with the most tokens (among those with more than one sequence)
   into two halves balanced by tokens, longest first;
3. the micro-batches go to the data-parallel ranks by Karmarkar-Karp on their
   FLOPs with equal counts per rank.

Where slime would run out of memory (a micro-batch over the config's cap),
K grows by one until none does: the budget a run that does not crash needs.
The config is megatron's (the cheapest that holds the run's longest sequence).
"""

from __future__ import annotations

import time

import numpy as np

from hydraulis.limits import check_lengths
from hydraulis.planner.dispatch import karmarkar_karp
from hydraulis.planner.planner import finalize
from hydraulis.planner.policy import PolicyContext
from hydraulis.planner.pool import fallback_config, homogeneous
from hydraulis.planner.schedule import Schedule
from hydraulis.specs import ModelSpec


def forward_flops(model: ModelSpec, lengths: np.ndarray) -> np.ndarray:
    """slime's forward FLOPs of each sequence: every layer's GEMMs and causal attention, and the head."""
    s = np.asarray(lengths, dtype=np.float64)
    q_dim = model.heads * model.head_dim
    gemm = 2.0 * (model.params_per_layer - 2 * model.hidden)  # the norms' weights do no GEMM
    attention = 2.0 * q_dim  # QK^T (causal, half) and AV (whole), per squared token
    return model.layers * (gemm * s + attention * s * s) + 2.0 * model.hidden * model.vocab_rows * s


def split_by_tokens(members: list[int], lengths: np.ndarray) -> tuple[list[int], list[int]]:
    """Two halves of a micro-batch balanced by tokens, longest first to the lighter half."""
    halves: tuple[list[int], list[int]] = ([], [])
    sums = [0, 0]
    for i in sorted(members, key=lambda i: -int(lengths[i])):
        h = 0 if sums[0] <= sums[1] else 1
        halves[h].append(i)
        sums[h] += int(lengths[i])
    return halves


class SlimeFlops:
    """slime's FLOPs-balanced micro-batches on one homogeneous deployment (the module docstring)."""

    name = "slime-flops"

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.cost = ctx.cost
        config = fallback_config(ctx.cost, ctx.cluster, ctx.run_max_length, ctx.sample, lone=False)
        self.deployment = homogeneous(config, ctx.cluster)
        self.cap = ctx.cost.cap(config, ctx.num_gpus)

    def micro_batches(self, lengths: np.ndarray, flops: np.ndarray) -> list[list[int]]:
        """Step 1: K micro-batches by Karmarkar-Karp on FLOPs, K from the token budget (raised until they fit)."""
        n = len(lengths)
        k = max(1, -(-int(lengths.sum()) // self.cap))
        while k < n:
            parts = [p for p in karmarkar_karp(flops, k) if p]
            if all(int(lengths[p].sum()) <= self.cap for p in parts):
                return [sorted(p) for p in parts]
            k += 1
        return [[i] for i in range(n)]

    def schedule(self, lengths: np.ndarray, step: int = 0) -> Schedule:
        start = time.perf_counter()
        lengths = check_lengths(lengths)
        flops = forward_flops(self.ctx.cost.model, lengths)
        bins = self.micro_batches(lengths, flops)
        dp = len(self.deployment)
        target = max(-(-len(bins) // dp) * dp, dp)
        while len(bins) < target and any(len(b) > 1 for b in bins):  # step 2
            k = max((j for j in range(len(bins)) if len(bins[j]) > 1), key=lambda j: int(lengths[bins[j]].sum()))
            bins[k], extra = split_by_tokens(bins[k], lengths)
            bins.append(extra)
        bins += [[] for _ in range(target - len(bins))]  # too few sequences to split: some ranks idle
        weights = np.array([float(flops[b].sum()) for b in bins])
        ranks = karmarkar_karp(weights, dp, equal_size=True)  # step 3
        micro = [[bins[j] for j in sorted(part) if bins[j]] for part in ranks]
        plan = finalize(step, lengths, self.deployment, micro_batches=micro, cost=self.cost, started=start)
        return Schedule.single(plan)
