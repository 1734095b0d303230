"""megatron-dcp: Megatron-LM's dynamic context parallelism (docs/design.md, section 5).

Megatron-LM (dev branch, `--dynamic-context-parallel`, scheduler
`default_dynamic_cp`: megatron/core/datasets/data_schedule.py's
DefaultDynamicCPScheduler and data_schedule_utils.py's packing-aware group
former) keeps one (tp, pp) model per data-parallel rank and, for every
micro-batch, groups the D = dp x cp ranks into CP groups of power-of-two sizes,
one per sequence length: a sequence of L tokens needs
2^ceil(log2(L / max_seqlen_per_dp_cp_rank)) ranks. Per micro-batch, longest
first:

1. the longest pending sequence opens a group of the size it needs;
2. each next sequence, at its own size or any larger power of two, joins a group
   of that size whose per-rank tokens stay within max_seqlen_per_dp_cp_rank, or
   opens a group on free ranks; of these the placement with the least
   resulting maximum rank workload (L^2 / cp, the scheduler's estimate) wins,
   if that maximum stays within 1.05 x longest x max_seqlen_per_dp_cp_rank;
   otherwise the sequence waits for a later micro-batch;
3. ranks left empty: the smallest group doubles over the next ranks (the later
   groups move up), again while any are empty; when no group can, the whole
   micro-batch becomes one group of all D ranks packing the pending sequences
   (longest first) up to the budget.

Here max_seqlen_per_dp_cp_rank is the (tp, pp) replica's cap, and a group of
size c also holds no more than the cost model's cap of (tp, pp, cp=c) (the K/V
it keeps): a sequence that needs more takes the next power of two. Times come
from the cost model (CP coefficients by `cost.context_parallel.cp_coefficients`,
an analytic extension, as `+cp` models have them): micro-batch k of a group starts
once all its ranks finished micro-batch k - 1 (their CP collectives couple
them), plus a (pp - 1) x longest-stage bubble; then one gradient sync. The
(tp, pp) is the one fastest on the sample batches among those whose D ranks
hold the run's longest sequence.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from hydraulis.cost.context_parallel import with_cp_configs
from hydraulis.cost.model import CostModel
from hydraulis.errors import HydraulisError
from hydraulis.limits import check_lengths
from hydraulis.parallel import ParallelConfig
from hydraulis.planner.plan import IterationPlan
from hydraulis.planner.planner import finalize
from hydraulis.planner.policy import PolicyContext
from hydraulis.planner.pool import place, replicable_configs
from hydraulis.planner.schedule import Schedule

WORKLOAD_SLACK = 0.05  # Megatron's _DYNAMIC_CP_WORKLOAD_CAP_DELTA


@dataclass
class Group:
    """One CP group of a micro-batch: consecutive ranks, the batch positions it runs."""

    first: int
    size: int
    members: list[int] = field(default_factory=list)
    tokens: int = 0


@dataclass(frozen=True)
class MicroBatch:
    groups: tuple[Group, ...]


class DynamicCP:
    """Megatron's default dynamic-CP scheduler on one (tp, pp) base config (the module docstring)."""

    name = "megatron-dcp"

    def __init__(self, ctx: PolicyContext, base: ParallelConfig | None = None) -> None:
        self.ctx = ctx
        bases = [base] if base is not None else candidate_bases(ctx)
        if not bases:
            raise HydraulisError(
                f"megatron-dcp: no (tp, pp) replicates over {ctx.num_gpus} GPUs and holds "
                f"a sequence of {ctx.run_max_length} tokens over its CP groups"
            )
        best = None
        for g in bases:
            self._use(g)
            t = float(np.mean([self._time(self.micro_batches(b), b) for b in ctx.sample]))
            if best is None or t < best[0]:
                best = (t, g)
        assert best is not None
        self._use(best[1])

    def _use(self, base: ParallelConfig) -> None:
        self.base = base
        self.ranks = self.ctx.num_gpus // base.num_gpus
        sizes = sorted({*(2**k for k in range(int(math.log2(self.ranks)) + 1)), self.ranks})
        self.configs = {c: ParallelConfig(base.tp, base.pp, c) if c > 1 else base for c in sizes}
        cost = self.ctx.cost
        self.cost: CostModel = with_cp_configs(
            cost, [g for g in self.configs.values() if g.cp > 1 and g not in cost.configs], cost.name + "+dcp"
        )
        self.budget = self.cost.cap(base, self.ctx.num_gpus)
        self.caps = {c: self.cost.cap(g, self.ctx.num_gpus) for c, g in self.configs.items()}

    def needed(self, length: int) -> int | None:
        """The group size of a sequence: the power of two its tokens per rank need, larger if its cap says so."""
        c = max(1, 2 ** math.ceil(math.log2(length / self.budget)))
        while c <= self.ranks and self.caps.get(c, 0) < length:
            c *= 2
        return c if c <= self.ranks else (self.ranks if self.caps[self.ranks] >= length else None)

    def micro_batches(self, lengths: np.ndarray) -> list[MicroBatch]:
        pending = [int(i) for i in np.argsort(-lengths, kind="stable")]
        out = []
        while pending:
            groups, pending = self._next(lengths, pending)
            out.append(MicroBatch(tuple(groups)))
        return out

    def _next(self, lengths: np.ndarray, pending: list[int]) -> tuple[list[Group], list[int]]:
        """One micro-batch over all D ranks (steps 1-3 of the module docstring); returns the groups and the rest."""
        D = self.ranks
        tall = int(lengths[pending[0]])
        size = self.needed(tall)
        if size is None:
            raise HydraulisError(
                f"megatron-dcp: a sequence of {tall} tokens is longer than {D} ranks of {self.base.name} hold "
                f"({self.caps[D]} tokens)"
            )
        load = np.zeros(D)
        groups = [Group(0, size)]
        owner = np.full(D, -1)
        owner[:size] = 0
        bound = tall * self.budget * (1 + WORKLOAD_SLACK)
        leftovers = []
        for i in pending:
            placed = self._place(
                i, int(lengths[i]), groups=groups, owner=owner, load=load, bound=bound, first=i == pending[0]
            )
            if not placed:
                leftovers.append(i)
        while (owner < 0).any():
            if not self._expand(groups, owner, load, lengths):
                return self._whole(lengths, pending)
        return groups, leftovers

    def _place(self, i: int, length: int, groups: list[Group], owner: np.ndarray, load: np.ndarray,
               bound: float, first: bool) -> bool:
        """Sequence i into the group (existing, or new on free ranks) that keeps the busiest rank least busy."""
        if first:
            self._add(groups[0], i, length, load)
            return True
        c, best = self.needed(length), None
        while c is not None and c <= self.ranks:
            work = length * length / c
            for k, g in enumerate(groups):
                fits = (g.tokens + length) / c <= self.budget and g.tokens + length <= self.caps[c]
                if g.size == c and fits:
                    peak = max(float(load.max()), float(load[g.first : g.first + c].max()) + work)
                    if peak <= bound and (best is None or peak < best[0]):
                        best = (peak, k)
            free = np.flatnonzero(owner < 0)
            if len(free) >= c and length <= self.caps[c]:
                peak = max(float(load.max()), work)
                if peak <= bound and (best is None or peak < best[0]):
                    best = (peak, -c)
            c = c * 2 if c < self.ranks else None
        if best is None:
            return False
        if best[1] < 0:
            first_free = int(np.flatnonzero(owner < 0)[0])
            owner[first_free : first_free - best[1]] = len(groups)
            groups.append(Group(first_free, -best[1]))
            self._add(groups[-1], i, length, load)
        else:
            self._add(groups[best[1]], i, length, load)
        return True

    @staticmethod
    def _add(g: Group, i: int, length: int, load: np.ndarray) -> None:
        g.members.append(i)
        g.tokens += length
        load[g.first : g.first + g.size] += length * length / g.size

    def _expand(self, groups: list[Group], owner: np.ndarray, load: np.ndarray, lengths: np.ndarray) -> bool:
        """The smallest group that can, doubled over the next ranks (later groups move up); False if none can."""
        empty = int(np.flatnonzero(owner < 0)[0])
        smallest = min(g.size for g in groups)
        grown = min(2 * smallest, self.ranks)
        extra = grown - smallest
        for g in sorted(groups, key=lambda g: g.first):
            end = g.first + g.size
            if g.size != smallest or end > empty or end - 1 + extra >= self.ranks:
                continue
            for h in groups:
                if h.first >= end:
                    h.first += extra
            g.size = grown
            owner[:] = -1
            load[:] = 0.0
            for j, h in enumerate(groups):
                owner[h.first : h.first + h.size] = j
                load[h.first : h.first + h.size] = sum(float(lengths[m]) ** 2 for m in h.members) / h.size
            return True
        return False

    def _whole(self, lengths: np.ndarray, pending: list[int]) -> tuple[list[Group], list[int]]:
        """One group of all D ranks, packing the pending sequences longest first up to the budget."""
        g, rest = Group(0, self.ranks), []
        for i in pending:
            length = int(lengths[i])
            if (g.tokens + length) / self.ranks <= self.budget and g.tokens + length <= self.caps[self.ranks]:
                g.members.append(i)
                g.tokens += length
            else:
                rest.append(i)
        if not g.members:
            raise HydraulisError(f"megatron-dcp: no sequence fits {self.ranks} ranks of {self.base.name}")
        return [g], rest

    def _time(self, steps: list[MicroBatch], lengths: np.ndarray) -> float:
        """Micro-batches in order, each group when all its ranks are free, then the bubble and the sync."""
        free = np.zeros(self.ranks)
        longest = 0.0
        for mb in steps:
            for g in mb.groups:
                t = self.cost.stage_time(self.configs[g.size], lengths[g.members])
                start = float(free[g.first : g.first + g.size].max())
                free[g.first : g.first + g.size] = start + t
                longest = max(longest, t)
        base = (self.base,) * self.ranks
        return float(free.max()) + (self.base.pp - 1) * longest + self.cost.step_time(base)

    def schedule(self, lengths: np.ndarray, step: int = 0) -> Schedule:
        start = time.perf_counter()
        lengths = check_lengths(lengths)
        steps = self.micro_batches(lengths)
        total = self._time(steps, lengths)
        plans, indices = [], []
        for mb in steps:
            plan, idx = self._plan(lengths, mb, step, start)
            plans.append(plan)
            indices.append(idx)
        return Schedule(
            step=step, lengths=tuple(int(x) for x in lengths), phases=tuple(plans), indices=tuple(indices),
            switch_s=0.0, iteration_time_s=total, planning_time_s=time.perf_counter() - start,
        )

    def _plan(self, lengths: np.ndarray, mb: MicroBatch, step: int, start: float) -> tuple[IterationPlan, tuple]:
        """One micro-batch as a plan: each CP group a replica with one micro-batch (for validation and the bench)."""
        groups = sorted(mb.groups, key=lambda g: g.first)
        configs = [self.configs[g.size] for g in groups]
        deployment = place(configs, self.ctx.cluster)
        if deployment is None:
            raise HydraulisError(f"megatron-dcp: cannot place {configs} on {self.ctx.num_gpus} GPUs")
        idx = tuple(int(i) for g in groups for i in g.members)
        pos = {i: k for k, i in enumerate(idx)}
        micro = [[[pos[i] for i in g.members]] for g in groups]
        plan = finalize(step, lengths[list(idx)], deployment, micro_batches=micro, cost=self.cost, started=start)
        return plan, idx


def candidate_bases(ctx: PolicyContext) -> list[ParallelConfig]:
    """(tp, pp) configs, any pp (Megatron runs dynamic CP beside PP), replicating over the cluster, whose D
    ranks hold the longest sequence."""
    out = []
    for g in replicable_configs(ctx.cost, ctx.cluster):
        if g.cp != 1:
            continue
        probe = DynamicCP.__new__(DynamicCP)
        probe.ctx = ctx
        probe._use(g)
        if probe.budget > 0 and probe.needed(ctx.run_max_length) is not None:  # a deep base may hold only lone
            out.append(g)
    return out

