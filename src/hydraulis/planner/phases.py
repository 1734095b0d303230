"""Phases within an iteration: a global batch run as a short sequence of deployments, each on part of it.

One deployment must hold a batch's longest sequence, so with one deployment per iteration every short sequence
pays for the parallelism the longest needs (on a small cluster, often one large replica for all). A phased
plan runs the long sequences on a deployment that holds them and the others on deployments that run them
faster, one after the other (HotSPa's temporal switching, with Hydraulis's heterogeneous deployments in every
phase). Gradients accumulate in the owners across phases and the optimizer steps once; a phase change costs
one more exchange: the reduce of the phase's gradients and the gather into the next layout
(`schedule.phase_switch_time`, as the profile measured them for the two deployments).

The search: the pool's deployments hold sequences up to their largest cap, so the batch, sorted by length, is
cut at those caps (which deployments may run a range changes there) and after its k longest for each k of
TOP_CUTS (a few may run alone, the next with the bulk; idle long replicas take bulk work). A dynamic programme
over the cuts, on dispatch estimates, finds the best split into 2..MAX_PHASES ranges, switches included; the
most promising splits, and those at the caps alone, are planned in full (each phase by the planner, on the
pool deployment its simulation prefers) and the fastest simulated schedule, single phase included, wins; the
cut before its last phase is then moved by simulation a few times (`_refine_cut`). The phase holding the longest
sequences runs last.

The pool must hold the phases' deployments: the proposal adds them (`proposal/phased.py`), among them
hotspa's (`homogeneous_split`), which pay only together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.errors import HydraulisError
from hydraulis.limits import check_lengths
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.dispatch import BULK_MIN_SEQUENCES, NoRoom
from hydraulis.planner.oracles.deferred_packing import defer_faster
from hydraulis.planner.plan import IterationPlan
from hydraulis.planner.planner import Planner
from hydraulis.planner.pool import range_estimates
from hydraulis.planner.replicas import ReplicaTable
from hydraulis.planner.schedule import Schedule, mean_switch_time, phase_compute_s, phase_switch_time, phases_time

MAX_PHASES = 3
FULL_SPLITS = 2  # splits planned in full after the estimate
LEVEL_RATIO = 1.5  # the proposal's phase levels at least this far apart (`spaced_levels`)
MIN_GAIN = 0.002  # a phased schedule must beat one phase by this share: a switch is not free to get right
TOP_CUTS = (*range(1, 9), 12, 16, 24, 32, 48, 64)  # the batch is cut after its k longest too (`splits`)
# plans of the last phase's cut moved by simulation (`_refine_cut`); the proposal's planners plan none (its time)
CUT_PLANS = 6


@dataclass(frozen=True)
class Split:
    """Batch positions of each phase, in execution order, and the estimated iteration (switches included)."""

    phases: tuple[np.ndarray, ...]
    estimate_s: float


class PhasedPlanner(Planner):
    """The planner, choosing per batch between one deployment and a sequence of phases (the `hydraulis` policy)."""

    _later: Planner | None = None  # plans the phases after the first (built on first use)

    def __init__(self, *args, cut_plans: int = CUT_PLANS, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cut_plans = cut_plans

    def schedule(self, lengths: np.ndarray, step: int = 0) -> Schedule:
        """The fastest simulated schedule: the single-phase plan, or the best of the most promising splits."""
        start = time.perf_counter()
        lengths = check_lengths(lengths)
        with self._scoped_memo():
            best = Schedule.single(self.plan(lengths, step))
            self.remember(step)
            if len(self.pool) > 1:
                # the best splits at the caps alone too: a count cut's estimate may crowd out one that simulates faster
                both = [*self.splits(lengths, ())[:FULL_SPLITS], *self.splits(lengths)[:FULL_SPLITS]]
                chosen: tuple[int, ...] = ()
                for split in {tuple(len(p) for p in x.phases): x for x in both}.values():  # sizes: the cuts
                    try:
                        candidate = self._plan_split(lengths, split, step)
                    except HydraulisError:  # a phase no deployment has room for: the split is not a candidate
                        continue
                    if candidate.iteration_time_s < best.iteration_time_s * (1 - MIN_GAIN):
                        best, chosen = candidate, tuple(len(p) for p in split.phases)
                if chosen:
                    best = self._refine_cut(lengths, chosen, best, step)
            best = self._repacked(lengths, best)
        elapsed = time.perf_counter() - start
        phases = best.phases
        if len(phases) == 1:
            phases = (dataclasses.replace(phases[0], planning_time_s=elapsed),)
        return dataclasses.replace(best, phases=phases, planning_time_s=elapsed)

    def _repacked(self, lengths: np.ndarray, schedule: Schedule) -> Schedule:
        """The chosen schedule, with `zero_bubble` each phase's slowest replicas packed and ordered again on deferred
        times (`oracles.deferred_packing`) on the planner that planned it: once per schedule, not per candidate."""
        if not self.zero_bubble:
            return schedule
        planners = [self._later_planner() if k else self for k in range(len(schedule.phases))]
        plans = tuple(defer_faster(p, q.cost, q._table(p.deployment, p.lengths_array),
                                   len(p.lengths) >= BULK_MIN_SEQUENCES) for p, q in zip(schedule.phases, planners,
                                                                                         strict=True))
        if all(a is b for a, b in zip(plans, schedule.phases, strict=True)):
            return schedule
        if len(plans) == 1:
            return Schedule.single(plans[0])
        return self._phased(lengths, [np.asarray(i, dtype=np.int64) for i in schedule.indices], plans, schedule.step)

    @contextlib.contextmanager
    def _scoped_memo(self) -> Iterator[None]:
        """One batch's memo where the planner keeps none: the splits' estimates dispatch the parts their plans
        screen again, and two splits often share a phase (the short one of a 2- and a 3-phase split), planned
        alike; dispatch and packing are deterministic, so a memo changes no plan."""
        later = self._later_planner()
        kept = self._memo, later._memo
        if self._memo is None:
            self._memo = {}
            later._memo = {}
        try:
            yield
        finally:
            self._memo = kept[0]
            later._memo = kept[1]

    @property
    def switch_s(self) -> float:
        """A switch before the phases' deployments are planned (the splits' estimate): the pool's slowest."""
        configs = tuple({c for d in self.pool for c in d.configs})
        return phase_switch_time(self.cost, self.num_gpus, configs, configs)

    def splits(self, lengths: np.ndarray, top_cuts: Sequence[int] = TOP_CUTS) -> list[Split]:
        """Splits into 2..MAX_PHASES length ranges, cut at the caps or after the k longest (`top_cuts`); best first."""
        order = np.argsort(lengths, kind="stable")
        s = lengths[order]
        tables = self._tables_for(lengths)  # caps for the counts the batch may pack (a part packs no more)
        tops = np.array([int(t.cap.max()) for t in tables])
        lone = np.array([int(t.lone_cap.max()) for t in tables])  # what a replica's only micro-batch holds
        levels = sorted({int(c) for c in tops if s[0] <= c < s[-1]})
        at_caps = (int(np.searchsorted(s, lv, side="right")) for lv in levels)
        cuts = sorted({0, len(s), *at_caps, *(len(s) - k for k in top_cuts if k < len(s))})
        m = len(cuts)
        if m < 3:
            return []
        est = np.full((m, m), np.inf)
        for i in range(m):
            for j in range(i + 1, m):
                est[i, j] = self._estimate(s[cuts[i] : cuts[j]], lone)
        # best[p, j]: the first cuts[j] sorted sequences in p phases; back[p, j] the cut before the last phase.
        best = np.full((MAX_PHASES + 1, m), np.inf)
        back = np.zeros((MAX_PHASES + 1, m), dtype=np.int64)
        best[0, 0] = 0.0
        for p in range(1, MAX_PHASES + 1):
            for j in range(1, m):
                totals = best[p - 1, :j] + est[:j, j]
                back[p, j] = int(np.argmin(totals))
                best[p, j] = totals[back[p, j]]
        out = []
        for p in range(2, MAX_PHASES + 1):
            if not np.isfinite(best[p, m - 1]):
                continue
            bounds, j = [m - 1], m - 1
            for q in range(p, 0, -1):
                j = int(back[q, j])
                bounds.append(j)
            bounds = bounds[::-1]
            phases = tuple(order[cuts[bounds[q]] : cuts[bounds[q + 1]]] for q in range(p))
            out.append(Split(phases, float(best[p, m - 1]) + (p - 1) * self.switch_s))
        return sorted(out, key=lambda x: x.estimate_s)

    def _refine_cut(self, lengths: np.ndarray, sizes: tuple[int, ...], best: Schedule, step: int) -> Schedule:
        """`best`, planned on a split of phases of `sizes` (sorted order), or a faster schedule with the cut before
        its last phase moved: a pattern search over the last phase's count k by simulation (steps of k / 8, halved
        where neither neighbour is faster), at most `cut_plans` plans; of three phases, then the first two as one
        too. The splits' greedy estimates rank cuts only roughly: long-70b-256g's long phase planned 33 and 37
        sequences where 27 and 33 simulate 1.0% and 1.1% faster; long-70b-128g's second batch, three phases
        where two at the moved cut simulate 1.1% faster (docs/results.md, h-eff)."""
        order, n = np.argsort(lengths, kind="stable"), len(lengths)
        edges = np.cumsum((0, *sizes))  # phase q holds order[edges[q]:edges[q + 1]]
        # a moved cut keeps each phase's deployment where it still holds the phase: no screen of the pool again
        on = tuple(p.deployment for p in best.phases) if len(best.phases) == len(sizes) else None
        tried, k, move, plans = {sizes[-1]}, sizes[-1], max(1, sizes[-1] // 8), 0
        while move >= 1 and plans < self.cut_plans:
            found = None
            for c in [c for c in (k + move, k - move) if c not in tried and 1 <= c < n - edges[-3]]:
                if plans == self.cut_plans:
                    break
                tried.add(c)
                plans += 1
                parts = (*(order[edges[q] : edges[q + 1]] for q in range(len(sizes) - 2)),
                         order[edges[-3] : n - c], order[n - c :])
                with contextlib.suppress(HydraulisError):  # a phase no deployment has room for
                    candidate = self._plan_split(lengths, Split(parts, 0.0), step, on, best.iteration_time_s)
                    if candidate is not None and candidate.iteration_time_s < best.iteration_time_s:
                        best, found = candidate, c
            if found is None:
                move //= 2
            else:
                k = found
        if len(sizes) > 2 and self.cut_plans:  # the phases before the last as one, beside the last at its cut
            with contextlib.suppress(HydraulisError):
                candidate = self._plan_split(lengths, Split((order[: n - k], order[n - k :]), 0.0), step)
                best = candidate if candidate.iteration_time_s < best.iteration_time_s else best
        return best

    def _estimate(self, part: np.ndarray, lone: np.ndarray) -> float:
        """The greedy makespan of a phase on the best deployment that holds it (inf where none has room): those
        with the lowest floor (`work_floor`) first, none dispatched whose floor is above the best so far."""
        tables = self._tables_for(part)
        floors = {int(k): work_floor(tables[k], part) for k in np.flatnonzero(lone >= part[-1])}
        best = np.inf
        for k in sorted(floors, key=floors.__getitem__):
            if floors[k] > best * (1 + 1e-9):  # a margin over float rounding
                break
            try:
                best = min(best, self._greedy(part, k).makespan_s)
            except NoRoom:  # more sequences beyond the caps than lone micro-batches to hold them
                continue
        return best

    def _later_planner(self) -> Planner:
        """The planner of the phases after the first (built on first use; its memo a part of this one's)."""
        if self._later is None:
            self._later = Planner(self.cost.later_phase(), self.num_gpus, self.pool, method=self.method,
                                  milp_time_limit_s=self.milp_time_limit_s, full_candidates=self.full_candidates,
                                  refine_rounds=self.refine_rounds, zero_bubble=self.zero_bubble,
                                  memo=None if self._memo is None else self._memo.setdefault("later", {}))
        return self._later

    def _plan_split(self, lengths: np.ndarray, split: Split, step: int, on: tuple[Deployment, ...] | None = None,
                    beat: float = np.inf) -> Schedule | None:
        """Every phase planned on its own (the planner picks its deployment; with `on`, that phase's deployment
        where it holds the phase), then the whole simulated; a later phase within the caps left beside the earlier
        phases' reduced gradient (`CostModel.later_phase`). Where the planner picks one deployment for consecutive
        phases, they are planned as one phase on it too and the faster kept (`_merged`): a phase apart on the
        same deployment pays only for memory. None where the schedule surely takes `beat` or more: with `on`, the
        largest phase (thousands of sequences, against a few) is planned last and gives up as soon as a replica
        of it leaves the others too little (`Planner.plan_within`)."""
        planners = [self._later_planner() if k else self for k in range(len(split.phases))]
        bulk = int(np.argmax([len(p) for p in split.phases]))
        plans: list[IterationPlan | None] = [None] * len(split.phases)
        for k in sorted(range(len(plans)), key=lambda k: k == bulk):  # the largest last
            lose = self._bulk_beat(plans, on, beat) if k == bulk and on is not None else np.inf
            plans[k] = self._phase_plan(planners[k], lengths[split.phases[k]], step, None if on is None else on[k],
                                        lose)
            if plans[k] is None:
                return None
        done = tuple(p for p in plans if p is not None)
        phased = self._phased(lengths, split.phases, done, step)
        merged = self._merged(lengths, split.phases, done, step)
        return merged if merged is not None and merged.iteration_time_s <= phased.iteration_time_s else phased

    def _bulk_beat(self, plans: Sequence[IterationPlan | None], on: tuple[Deployment, ...], beat: float) -> float:
        """What the one phase not planned yet (None in `plans`) must stay below, its slowest replica, for the
        schedule on `on` to take less than `beat` (`phases_time`; a margin over float rounding); inf where a
        planned phase left its deployment (the switch differs) or two in a row share one (`_merged` may win)."""
        pairs = list(itertools.pairwise(on))
        if (not np.isfinite(beat) or self.cost.shared_cores is not None or any(a == b for a, b in pairs)
                or any(p.deployment != d for p, d in zip(plans, on, strict=True) if p is not None)):
            return np.inf
        switches = sum(phase_switch_time(self.cost, self.num_gpus, a.configs, b.configs) for a, b in pairs)
        rest = sum(phase_compute_s(p, self.cost) for p in plans if p is not None)
        return beat * (1 + 1e-9) - rest - switches - self.cost.step_time(on[-1].configs)

    @staticmethod
    def _phase_plan(planner: Planner, lengths: np.ndarray, step: int, on: Deployment | None,
                    beat: float = np.inf) -> IterationPlan | None:
        """The phase on `on` where it holds the phase (None where its slowest replica surely takes `beat` or
        more), else on the deployment the planner picks."""
        if on is not None:
            with contextlib.suppress(HydraulisError):
                return planner.plan_within(lengths, on, step, beat)
        return planner.plan(lengths, step, outlook=False)

    def _phased(self, lengths: np.ndarray, parts: Sequence[np.ndarray], plans: tuple[IterationPlan, ...],
                step: int) -> Schedule:
        switch_s = mean_switch_time(plans, self.cost)
        total = phases_time(plans, self.cost, switch_s)
        indices = tuple(tuple(int(i) for i in idx) for idx in parts)
        return Schedule(step=step, lengths=tuple(int(x) for x in lengths), phases=plans, indices=indices,
                        switch_s=switch_s, iteration_time_s=total, planning_time_s=0.0)

    def _merged(self, lengths: np.ndarray, parts: Sequence[np.ndarray], plans: tuple[IterationPlan, ...],
                step: int) -> Schedule | None:
        """Each run of consecutive phases on one deployment planned as one phase on it (neighbouring length
        ranges, each planned on its own, may go to one deployment); None where none is, or a merge has no room."""
        runs = [[k for k, _ in run] for _, run in itertools.groupby(enumerate(plans), key=lambda x: x[1].deployment)]
        if len(runs) == len(plans):
            return None
        later = self._later_planner()
        merged = [np.concatenate([parts[k] for k in run]) for run in runs]
        try:
            if len(runs) == 1:
                return Schedule.single(self.plan_on(lengths, plans[0].deployment, step))
            again = tuple((later if n else self).plan_on(lengths[idx], plans[run[0]].deployment, step)
                          for n, (run, idx) in enumerate(zip(runs, merged, strict=True)))
        except HydraulisError:  # the merged phase has no room: its sequences fit only in phases apart
            return None
        return self._phased(lengths, merged, again, step)


def work_floor(table: ReplicaTable, lengths: np.ndarray) -> float:
    """At most any dispatch's makespan of `lengths` on the table's deployment (no bias): a replica's estimate is at
    least its work (`replicas.estimate_time`), so the slowest's at least the mean and the largest sequence's, each
    sequence at its least cost over the configs."""
    w = table.cost_matrix(lengths).min(axis=0)
    return max(float(w.sum()) / len(table), float(w.max()))


def spaced_levels(levels: Sequence[int], ratio: float = LEVEL_RATIO) -> list[int]:
    """The cap levels at least `ratio` apart (the lowest of each run kept): the whole TP x PP x CP space has
    hundreds of caps, a few percent apart, and a deployment chosen for a level holds the next ones too."""
    out: list[int] = []
    for level in levels:
        if not out or level >= out[-1] * ratio:
            out.append(level)
    return out


def homogeneous_split(
    cost: CostModel, num_gpus: int, configs: Sequence[ParallelConfig], lengths: np.ndarray, switch_s: float,
    later: CostModel | None = None,
) -> list[tuple[np.ndarray, int]]:
    """HotSPa's split (baselines/hotspa.py), which the proposal offers the planner too: the batch sorted by
    length, cut at config caps, each range on the homogeneous config whose estimate is least, a dynamic
    programme over the cuts with `switch_s` per switch. (batch positions, index into `configs`) per phase,
    shortest range first; empty where no config holds the longest sequence. `later`: the cost model of a phase
    after the first (`CostModel.later_phase`), whose caps then bind every range but the shortest."""
    order = np.argsort(lengths, kind="stable")
    s = lengths[order]
    first = np.array([cost.cap(g, num_gpus) for g in configs])
    caps = first if later is None else np.array([later.cap(g, num_gpus) for g in configs])
    cuts = np.array(sorted({0, *(int(np.searchsorted(s, c, side="right")) for c in (*first, *caps) if c >= s[0])}))
    m = len(cuts)
    lo, hi = np.meshgrid(cuts, cuts, indexing="ij")  # the range s[cuts[i]:cuts[j]] at [i, j]
    top = s[np.maximum(hi - 1, 0)]
    est = np.stack([np.where((hi > lo) & (np.where(lo == 0, cap0, cap) >= top),
                             range_estimates(cost, g, num_gpus, s, lo=lo, hi=hi), np.inf)
                    for g, cap0, cap in zip(configs, first, caps, strict=True)])
    pick, est = est.argmin(axis=0), est.min(axis=0)
    best = np.full(m, np.inf)
    best[0] = 0.0
    back = np.zeros(m, dtype=np.int64)
    for j in range(1, m):
        totals = best[:j] + est[:j, j] + np.where(np.arange(j) > 0, switch_s, 0.0)
        back[j] = int(np.argmin(totals))
        best[j] = totals[back[j]]
    if cuts[-1] != len(s) or not np.isfinite(best[-1]):
        return []
    phases = []
    j = m - 1
    while j > 0:
        i = int(back[j])
        phases.append((order[cuts[i] : cuts[j]], int(pick[i, j])))
        j = i
    return phases[::-1]
