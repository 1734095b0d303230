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
pool deployment its simulation prefers) and the fastest simulated schedule, single phase included, wins. The
phase holding the longest sequences runs last.

The pool must hold the phases' deployments: `phase_deployments` adds them to a proposed pool, among them
hotspa's (`homogeneous_split`), which pay only together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.bounds import lower_bounds
from hydraulis.planner.dispatch import NoRoom, dispatch
from hydraulis.planner.plan import IterationPlan
from hydraulis.planner.planner import Planner, check_lengths, later_phase
from hydraulis.planner.pool import homogeneous, range_estimates, replicable_configs, unique_deployments
from hydraulis.planner.replicas import ReplicaTable
from hydraulis.planner.schedule import Schedule, mean_switch_time, phase_switch_time, phases_time
from hydraulis.processes.fan_out import fan_out
from hydraulis.specs import ClusterSpec

MAX_PHASES = 3
FULL_SPLITS = 2  # splits planned in full after the estimate
LEVEL_RATIO = 1.5  # the proposal's phase levels at least this far apart (`spaced_levels`)
MIN_GAIN = 0.002  # a phased schedule must beat one phase by this share: a switch is not free to get right
PHASE_SAMPLES = 4  # sample batches the phased planner plans when choosing deployments for phases
SHORT_SHARE = 0.1  # a level at least this share of batches stop at counts as the samples cut there
LEVEL_KEEP = 8  # deployments per level the dispatch estimate ranks, the least work first (`_least_work`)
TOP_CUTS = (*range(1, 9), 12, 16, 24, 32, 48, 64)  # the batch is cut after its k longest too (`splits`)
STOP_RATIO = 1.2  # the levels between the samples' longest sequences at which they are clipped (`stop_levels`)
# deployments the pool's greedy adds together, the level they serve, and whether the samples are clipped there
Move = tuple[tuple[Deployment, ...], int, bool]


@dataclass(frozen=True)
class Split:
    """Batch positions of each phase, in execution order, and the estimated iteration (switches included)."""

    phases: tuple[np.ndarray, ...]
    estimate_s: float


class PhasedPlanner(Planner):
    """The planner, choosing per batch between one deployment and a sequence of phases (the `hydraulis` policy)."""

    _later: Planner | None = None  # plans the phases after the first (built on first use)

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
                for split in {tuple(len(p) for p in x.phases): x for x in both}.values():  # sizes: the cuts
                    try:
                        candidate = self._plan_split(lengths, split, step)
                    except HydraulisError:  # a phase no deployment has room for: the split is not a candidate
                        continue
                    if candidate.iteration_time_s < best.iteration_time_s * (1 - MIN_GAIN):
                        best = candidate
        elapsed = time.perf_counter() - start
        phases = best.phases
        if len(phases) == 1:
            phases = (dataclasses.replace(phases[0], planning_time_s=elapsed),)
        return dataclasses.replace(best, phases=phases, planning_time_s=elapsed)

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
        tops = np.array([int(t.cap.max()) for t in self._tables])
        lone = np.array([int(t.lone_cap.max()) for t in self._tables])  # what a replica's only micro-batch holds
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

    def _estimate(self, part: np.ndarray, lone: np.ndarray) -> float:
        """The greedy makespan of a phase on the best deployment that holds it (inf where none has room)."""
        best = np.inf
        for k in np.flatnonzero(lone >= part[-1]):
            try:
                best = min(best, self._greedy(part, int(k)).makespan_s)
            except NoRoom:  # more sequences beyond the caps than lone micro-batches to hold them
                continue
        return best

    def _later_planner(self) -> Planner:
        """The planner of the phases after the first (built on first use; its memo a part of this one's)."""
        if self._later is None:
            self._later = Planner(later_phase(self.cost), self.num_gpus, self.pool, method=self.method,
                                  milp_time_limit_s=self.milp_time_limit_s, full_candidates=self.full_candidates,
                                  refine_rounds=self.refine_rounds,
                                  memo=None if self._memo is None else self._memo.setdefault("later", {}))
        return self._later

    def _plan_split(self, lengths: np.ndarray, split: Split, step: int) -> Schedule:
        """Every phase planned on its own (the planner picks its deployment), then the whole simulated; a later
        phase within the caps left beside the earlier phases' reduced gradient (`CostModel.later_phase`). Where
        the planner picks one deployment for consecutive phases, they are planned as one phase on it too and
        the faster kept (`_merged`): a phase apart on the same deployment pays only for memory."""
        later = self._later_planner()
        plans = tuple((later if k else self).plan(lengths[idx], step) for k, idx in enumerate(split.phases))
        phased = self._phased(lengths, split.phases, plans, step)
        merged = self._merged(lengths, split.phases, plans, step)
        return merged if merged is not None and merged.iteration_time_s <= phased.iteration_time_s else phased

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


def spaced_levels(levels: Sequence[int], ratio: float = LEVEL_RATIO) -> list[int]:
    """The cap levels at least `ratio` apart (the lowest of each run kept): the whole TP x PP x CP space has
    hundreds of caps, a few percent apart, and a deployment chosen for a level holds the next ones too."""
    out: list[int] = []
    for level in levels:
        if not out or level >= out[-1] * ratio:
            out.append(level)
    return out


def homogeneous_split(
    cost: CostModel, num_gpus: int, configs: Sequence[ParallelConfig], lengths: np.ndarray, switch_s: float
) -> list[tuple[np.ndarray, int]]:
    """HotSPa's split (baselines/hotspa.py), which the proposal offers the planner too: the batch sorted by
    length, cut at config caps, each range on the homogeneous config whose estimate is least, a dynamic
    programme over the cuts with `switch_s` per switch. (batch positions, index into `configs`) per phase,
    shortest range first; empty where no config holds the longest sequence."""
    order = np.argsort(lengths, kind="stable")
    s = lengths[order]
    caps = np.array([cost.cap(g, num_gpus) for g in configs])
    cuts = np.array(sorted({0, *(int(np.searchsorted(s, c, side="right")) for c in caps if c >= s[0])}))
    m = len(cuts)
    lo, hi = np.meshgrid(cuts, cuts, indexing="ij")  # the range s[cuts[i]:cuts[j]] at [i, j]
    top = s[np.maximum(hi - 1, 0)]
    est = np.stack([np.where((hi > lo) & (cap >= top), range_estimates(cost, g, num_gpus, s, lo=lo, hi=hi), np.inf)
                    for g, cap in zip(configs, caps, strict=True)])
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


def phase_deployments(
    cost: CostModel,
    cluster: ClusterSpec,
    candidates: Sequence[Deployment],
    pool: Sequence[Deployment],
    batches: Sequence[np.ndarray],
    max_pool: int,
    min_gain: float = 0.002,
    whole: Sequence[Deployment] = (),
) -> tuple[list[Deployment], list[Schedule]]:
    """Deployments for the short phases of phased plans and short batches, which no sample chose whole, beside
    `whole` (chosen for whole samples), all competing for the pool's room.

    For each cap level below the longest sampled sequence, the candidate (or homogeneous deployment)
    whose dispatch estimate on the sequences up to that level is best, and hotspa's (`_hotspa_moves`);
    then, greedily while the pool has room, the move that most lowers the phased planner's iterations on
    the samples (and on them cut at its level, `_short_batches`). Returns those added and the phased
    planner's schedule of each of `batches` on the final pool."""
    N = cluster.num_gpus
    sample = list(batches[:PHASE_SAMPLES])
    longest = max(int(b.max()) for b in sample)
    # Every homogeneous deployment too, CP ones included: hotspa's phases, which the candidates lack
    # where a CP config does not hold the longest sequence (32b-16g-code: 1x tp4pp2cp2 up to 11K).
    every = (homogeneous(g, cluster) for g in replicable_configs(cost, cluster))
    candidates = unique_deployments([*candidates, *every])
    tops = {str(d): max(cost.cap(g, N) for g in d.configs) for d in candidates}
    levels = spaced_levels(sorted({t for t in tops.values() if t < longest}))
    tables: dict[str, ReplicaTable] = {}
    moves: list[Move] = [((d,), 0, False) for d in whole]  # chosen for whole batches: no level
    for level in levels:
        parts = [b[b <= level] for b in sample if (b <= level).any()]
        holding = [d for d in candidates if tops[str(d)] >= level and d not in pool and (d,) not in _bundles(moves)]
        if parts and (holding := _least_work(cost, N, holding, parts)):
            for d in holding:
                tables.setdefault(str(d), ReplicaTable.of(cost, d, N))
            est = fan_out(functools.partial(_estimate_on, parts, tables), holding)
            d = holding[int(np.argmin(est))]
            moves.append(((d,), min(tops[str(d)], longest - 1), False))  # the level: whole batches it holds
    for bundle, level, clip in _hotspa_moves(cost, cluster, sample, longest):
        if (bundle := tuple(d for d in bundle if d not in pool)) and bundle not in _bundles(moves):
            moves.append((bundle, level, clip))
    current, schedules = _greedy_phases(cost=cost, num_gpus=N, current=list(pool), moves=moves, sample=sample,
                                        max_pool=max_pool, min_gain=min_gain)
    added = current[len(pool) :]
    if len(batches) > len(sample):
        planner = PhasedPlanner(cost, N, current)
        schedules = [planner.schedule(b) for b in batches]
    return added, schedules


def _estimate_on(parts: list[np.ndarray], tables: dict[str, ReplicaTable], d: Deployment) -> float:
    """The dispatch estimates of the parts on `d`, summed."""
    return sum(dispatch(p, tables[str(d)], search=False).makespan_s for p in parts)


def _hotspa_moves(cost: CostModel, cluster: ClusterSpec, sample: Sequence[np.ndarray], longest: int) -> list[Move]:
    """The homogeneous deployments of hotspa's split (`homogeneous_split`) of each sample, and of the samples
    cut at each spaced cap level where at least SHORT_SHARE of batches stop, each as one move: their phases
    pay only together (32b-16g-code: tp4pp2cp2 up to 11K, then tp8pp1cp2, where either alone beside tp8pp2
    saves nothing), the last holds the longest sequence, where no level is sought, and a short batch may
    want what no sample does (7b-64g-wiki: 32x tp2pp1 for a third of batches)."""
    N = cluster.num_gpus
    configs = replicable_configs(cost, cluster)
    switch = phase_switch_time(cost, N)
    caps = sorted({c for g in configs if (c := cost.cap(g, N)) < longest and short_share(sample, c) >= SHORT_SHARE})
    cuts = [(list(sample), longest - 1, False),
            *((_short_batches(list(sample), lv), lv, False) for lv in spaced_levels(caps)),
            *((_short_batches(list(sample), lv, clip=True), lv, True) for lv in stop_levels(cost, N, configs, sample))]
    moves: dict[tuple[Deployment, ...], tuple[int, bool]] = {}
    for batches, level, clip in cuts:
        for b in batches:
            split = homogeneous_split(cost, N, configs, b, switch)
            bundle = tuple(homogeneous(configs[k], cluster) for _, k in split)
            if clip or bundle not in moves:  # where batches that stop there want it, its gain shows
                moves[bundle] = (level, clip)
    return [(m, *at) for m, at in moves.items() if m]


def stop_levels(
    cost: CostModel, num_gpus: int, configs: Sequence[ParallelConfig], sample: Sequence[np.ndarray]
) -> list[int]:
    """Lengths where batches like the samples stop that no sample does: the configs' caps between the samples'
    shortest and longest maxima, STOP_RATIO apart. A few samples show a few maxima; a batch whose longest
    sequence falls between them may want a deployment none of them does (long-7b-128g-512k: a batch that stops
    at 135K, between the samples' 85K and 153K, runs best on 4x tp8pp1cp4 beside 32x tp2pp1cp2)."""
    tops = [int(b.max()) for b in sample]
    caps = sorted({c for g in configs if min(tops) < (c := cost.cap(g, num_gpus)) < max(tops)})
    return spaced_levels(caps, STOP_RATIO)


def _bundles(moves: Sequence[Move]) -> list[tuple[Deployment, ...]]:
    return [m for m, _, _ in moves]


def _least_work(
    cost: CostModel, num_gpus: int, holding: Sequence[Deployment], parts: Sequence[np.ndarray], keep: int = LEVEL_KEEP
) -> list[Deployment]:
    """The `keep` deployments of the least lower bound on the parts over their own configs (`bounds.py`: the
    work of each sequence on its cheapest config that holds it, bubbles, trips), before dispatch ranks them."""
    sets = [list(dict.fromkeys(d.configs)) for d in holding]
    per_part = [lower_bounds(p, cost, num_gpus, sets) for p in parts]
    work = [sum(b[k] for b in per_part) for k in range(len(holding))]  # summed in order, as one at a time
    return [holding[i] for i in np.argsort(work, kind="stable")[:keep]]


def _greedy_phases(
    cost: CostModel,
    num_gpus: int,
    current: list[Deployment],
    moves: list[Move],
    sample: list[np.ndarray],
    max_pool: int,
    min_gain: float,
) -> tuple[list[Deployment], list]:
    """Add the move (a deployment, or hotspa's that pay together) that most lowers the samples' phased
    iterations, while the pool has room.

    Each candidate's planner plans the samples and their short cuts once; the pool's own short-cut
    times depend only on the level, so each round plans them once per level, not once per candidate."""
    memo: dict = {}  # every trial plans the samples on the current pool's deployments again: once is enough
    planner = PhasedPlanner(cost, num_gpus, current, memo=memo)
    schedules = [planner.schedule(b) for b in sample]
    while len(current) < max_pool:
        left = ((tuple(d for d in m if d not in current), level, clip) for m, level, clip in moves)
        moves = [(m, level, clip) for m, level, clip in left if m and len(current) + len(m) <= max_pool]
        if not moves:
            break
        base = float(sum(s.iteration_time_s for s in schedules))
        cuts = [_short_cuts(sample, level, clip) for _, level, clip in moves]
        # The sample batches on the cores (`fan_out`): a memo's plans are of one batch (or its cut), which the
        # trials of every move share, and the next rounds' too (the workers' come back into the memo).
        trials = functools.partial(_sample_trials, planner=planner, current=current, moves=moves, cuts=cuts,
                                   sample=sample)
        per_sample = fan_out(trials, range(len(sample)), memo=memo)
        trials, gains = [], []
        for i, cut in enumerate(cuts):
            found = [per_sample[j][i][0] for j in range(len(sample))]
            # what the move saves on the samples cut at its level, summed in the samples' order
            short = float(sum(per_sample[j][i][2] for j in cut)) - float(sum(per_sample[j][i][1] for j in cut))
            trials.append(found)
            gains.append(base - sum(s.iteration_time_s for s in found) + (short if cut else 0.0))
        k = int(np.argmax(gains))
        if gains[k] <= min_gain * base:
            break
        current, schedules = [*current, *moves[k][0]], trials[k]
        planner = PhasedPlanner(cost, num_gpus, current, memo=memo)
        # one that did not pay beside a smaller pool is not tried again (the lazy greedy: a pool that grows
        # leaves each deployment less to save)
        moves = [m for i, m in enumerate(moves) if i != k and gains[i] > min_gain * base]
    return current, schedules


def _sample_trials(
    j: int, planner: PhasedPlanner, current: list[Deployment], moves: list[Move], cuts: list[dict[int, np.ndarray]],
    sample: list[np.ndarray],
) -> list[tuple[Schedule, float, float]]:
    """Sample batch j on the pool with each move added: its schedule, and the move's and the current pool's
    iteration on the batch cut at the move's level (0 where it is not cut there; `_short_cuts`)."""
    before: dict[tuple[int, bool], float] = {}  # (level, clip) -> the current pool's iteration on the cut
    out = []
    for (m, level, clip), cut in zip(moves, cuts, strict=True):
        trial = PhasedPlanner(planner.cost, planner.num_gpus, [*current, *m], memo=planner._memo)
        after = 0.0
        if j in cut:
            if (level, clip) not in before:
                before[level, clip] = planner.schedule(cut[j]).iteration_time_s
            after = trial.schedule(cut[j]).iteration_time_s
        out.append((trial.schedule(sample[j]), after, before.get((level, clip), 0.0) if j in cut else 0.0))
    return out


def short_share(batches: Sequence[np.ndarray], level: int) -> float:
    """The share of batches like these with no sequence above `level` (each sequence drawn independently)."""
    above = float(np.mean(np.concatenate(batches) > level))
    return float((1.0 - above) ** np.mean([len(b) for b in batches]))


def _short_cuts(sample: list[np.ndarray], level: int, clip: bool = False) -> dict[int, np.ndarray]:
    """The samples cut at `level` (by sample index), if SHORT_SHARE of batches stop there: a short batch may want
    a deployment though no sample does (7b-64g-wiki: a third of batches fit tp2pp1's cap, none of 4 samples).
    `clip`: those longer than `level` with their longer sequences clipped to it, batches that stop there
    (`stop_levels`)."""
    if clip:
        return {j: np.minimum(b, level) for j, b in enumerate(sample) if int(b.max()) > level}
    if short_share(sample, level) < SHORT_SHARE:
        return {}
    return {j: b[b <= level] for j, b in enumerate(sample) if (b <= level).any()}


def _short_batches(sample: list[np.ndarray], level: int, clip: bool = False) -> list[np.ndarray]:
    """`_short_cuts`, in the samples' order."""
    return list(_short_cuts(sample, level, clip).values())
