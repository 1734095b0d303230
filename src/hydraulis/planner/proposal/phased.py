"""Deployments for phases: the pool's deployments that no whole sample chooses, for the short phases of phased
plans and for short batches (`phase_deployments`), chosen by the phased planner's iterations on the samples.

A short phase wants a deployment that runs the sequences up to some length faster than the deployment that
holds the longest, and a batch that stops short may want one no sample does; so the moves offered are the
best-estimated candidate per spaced cap level, hotspa's homogeneous phases (`phases.homogeneous_split`), and
the same on the samples cut or clipped where batches like them stop, added greedily while they pay; then, beside
the pool those built, long phases shaped for the samples' few longest sequences (`long_phase_deployments`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.bounds import lower_bound, lower_bounds
from hydraulis.planner.dispatch import dispatch
from hydraulis.planner.phases import PhasedPlanner, homogeneous_split, spaced_levels
from hydraulis.planner.plan import IterationPlan
from hydraulis.planner.pool import homogeneous, place, replicable_configs, unique_deployments
from hydraulis.planner.proposal.screen import worker_memo
from hydraulis.planner.replicas import ReplicaCost, ReplicaTable
from hydraulis.planner.schedule import Schedule, phase_switch_time
from hydraulis.processes.fan_out import fan_out, fan_out_grid
from hydraulis.specs import ClusterSpec

PHASE_SAMPLES = 4  # sample batches the phased planner plans when choosing deployments for phases
SHORT_SHARE = 0.1  # a level at least this share of batches stop at counts as the samples cut there
LEVEL_KEEP = 8  # deployments per level the dispatch estimate ranks, the least work first (`_least_work`)
STOP_RATIO = 1.2  # the levels between the samples' longest sequences at which they are clipped (`stop_levels`)
# a long phase's deployments are shaped for each sample's k longest (`long_deployments`); each costs the greedy the
# samples planned in full (k = 1 and 3 saved less than 2, 4, 6 on long-7b-64g's and long-7b-128g's samples)
LONG_TOPS = (2, 4, 6)
# deployments the pool's greedy adds together, the level they serve, and whether the samples are clipped there
Move = tuple[tuple[Deployment, ...], int, bool]


def phase_deployments(
    cost: CostModel,
    cluster: ClusterSpec,
    candidates: Sequence[Deployment],
    pool: Sequence[Deployment],
    batches: Sequence[np.ndarray],
    max_pool: int,
    min_gain: float = 0.002,
    whole: Sequence[Deployment] = (),
    memo: dict | None = None,
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
                                        max_pool=max_pool, min_gain=min_gain, memo=memo)
    return current[len(pool) :], _on_every_batch(cost, N, current, batches, schedules)


def trial_planner(
    cost: CostModel, num_gpus: int, pool: Sequence[Deployment], memo: dict | None = None
) -> PhasedPlanner:
    """The phased planner the proposal's trials plan with: no cut moved by simulation (`PhasedPlanner._refine_cut`,
    up to six plans more per batch, for every trial); the run's planner moves it."""
    return PhasedPlanner(cost, num_gpus, pool, memo=memo, cut_plans=0)


def _on_every_batch(
    cost: CostModel, num_gpus: int, pool: list[Deployment], batches: Sequence[np.ndarray], schedules: list[Schedule]
) -> list[Schedule]:
    """The phased planner's schedule of each of `batches` on `pool`, given `schedules` of its first PHASE_SAMPLES."""
    if len(batches) <= len(schedules):
        return schedules
    planner = trial_planner(cost, num_gpus, pool)
    return [planner.schedule(b) for b in batches]


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


def long_phase_deployments(
    cost: CostModel,
    cluster: ClusterSpec,
    pool: Sequence[Deployment],
    batches: Sequence[np.ndarray],
    schedules: list[Schedule],
    max_pool: int,
    min_gain: float = 0.002,
    memo: dict | None = None,
) -> tuple[list[Deployment], list[Schedule]]:
    """Long phases shaped for the samples' few longest sequences (`long_deployments`), added greedily beside `pool`
    (built by `phase_deployments`, `schedules` the batches' on it) while they lower the samples' phased iterations.
    Only added: a deployment of `pool` that the samples no longer use beside them stays, for batches unlike them
    (long-13b-128g: a shape took the samples' long phases from 4x tp8pp1cp4, which the bench's batch 1 runs 1% faster).
    Returns those added and the schedule of each of `batches` on the final pool."""
    N = cluster.num_gpus
    sample = list(batches[:PHASE_SAMPLES])
    configs = replicable_configs(cost, cluster)
    shaped = [*long_deployments(cost, cluster, configs, sample),
              *budget_deployments(cost, cluster, configs, sample, schedules)] if len(pool) < max_pool else []
    moves: list[Move] = [((d,), 0, False) for d in shaped if d not in pool]
    if not moves:
        return [], schedules
    current, found = _greedy_phases(cost=cost, num_gpus=N, current=list(pool), moves=moves, sample=sample,
                                    max_pool=max_pool, min_gain=min_gain, memo=memo)
    if len(current) == len(pool):
        return [], schedules
    return current[len(pool) :], _on_every_batch(cost, N, current, batches, found)


def long_deployments(
    cost: CostModel, cluster: ClusterSpec, configs: Sequence[ParallelConfig], sample: Sequence[np.ndarray],
    tops: Sequence[int] = LONG_TOPS,
) -> list[Deployment]:
    """Deployments for a long phase, shaped for each sample's k longest sequences (k of `tops`): one replica for
    each, of the config that gives the k the least slowest lone trip on the GPUs (the least GPU time next; a wide
    replica for the longest beside narrower ones for the next), the GPUs left to more replicas of the last one's
    config. The candidates' shapes (homogeneous, k large beside small) miss them: three 262K sequences on
    2x tp8pp1cp4 leave one replica idle for a third of the phase (long-7b-64g-longmix)."""
    N = cluster.num_gpus
    reps = [ReplicaCost.of(cost, g, N) for g in configs]
    sizes = np.array([g.num_gpus for g in configs])
    out = []
    for b in sample:
        s, trips = _longest_trips(reps, b, tops)
        for k in (t for t in tops if t <= len(s)):
            shape = _least_trips(trips[:k], sizes, N)
            if shape and (d := place(sorted((configs[j] for j in shape), key=lambda g: -g.num_gpus), cluster)):
                out.append(d)
    return unique_deployments(out)


def _longest_trips(
    reps: Sequence[ReplicaCost], batch: np.ndarray, tops: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """The batch's max(tops) longest sequences, longest first, and each one's lone trip through each config's
    pipeline, pp (w + c) [sequence, config] (inf where the config cannot hold it): what a long phase's shapes
    are chosen on."""
    s = np.sort(batch)[::-1][: max(tops, default=0)]
    return s, np.stack([r.pp * (r.least(s) + r.c) for r in reps], axis=1)


def _least_trips(trips: np.ndarray, sizes: np.ndarray, num_gpus: int) -> list[int]:
    """Config indices, one per row of `trips` [sequences, configs] and more of the last one's to fill `num_gpus`,
    of the least slowest trip, then the least GPU time (a dynamic programme over the GPUs used); [] where none."""
    k = len(trips)
    slowest = np.full(num_gpus + 1, np.inf)
    work = np.zeros(num_gpus + 1)
    slowest[0] = 0.0
    back = np.full((k, num_gpus + 1, 2), -1)  # (config, GPUs used before) per sequence and GPUs used after
    for i in range(k):
        nxt, nwork = np.full(num_gpus + 1, np.inf), np.zeros(num_gpus + 1)
        for j in np.flatnonzero(np.isfinite(trips[i])):
            used = np.arange(num_gpus + 1 - sizes[j])
            to = used + sizes[j]
            m, w = np.maximum(slowest[used], trips[i, j]), work[used] + sizes[j] * trips[i, j]
            better = np.isfinite(m) & ((m < nxt[to]) | ((m == nxt[to]) & (w < nwork[to])))
            nxt[to[better]], nwork[to[better]] = m[better], w[better]
            back[i, to[better]] = np.stack([np.full(better.sum(), j), used[better]], axis=1)
        slowest, work = nxt, nwork
    ends = [u for u in np.flatnonzero(np.isfinite(slowest)) if (num_gpus - u) % sizes[back[k - 1, u, 0]] == 0]
    if not ends:
        return []
    u = min(ends, key=lambda e: (slowest[e], work[e]))
    shape = [int(back[k - 1, u, 0])] * ((num_gpus - u) // int(sizes[back[k - 1, u, 0]]))
    for i in range(k - 1, -1, -1):
        shape.append(int(back[i, u, 0]))
        u = int(back[i, u, 1])
    return shape


def budget_deployments(
    cost: CostModel, cluster: ClusterSpec, configs: Sequence[ParallelConfig], sample: Sequence[np.ndarray],
    schedules: Sequence[Schedule], tops: Sequence[int] = LONG_TOPS,
) -> list[Deployment]:
    """Long phases that run bulk work beside the few longest sequences: for each sample's k longest (k of `tops`),
    one replica each, of the configs of the least GPU time in all whose lone trip fits the sample's bound LB*
    (`bounds.lower_bound`: no plan of the sample is faster, so such a trip never outlasts the iteration), the GPUs
    left to replicas of the sample's bulk config (`_bulk_config`, in its schedule on the pool), which take the
    next sequences beside them. `long_deployments` gives the longest the least trip, so the widest replicas, idle
    GPU time a phase of those sequences alone pays for: long-7b-128g's 153K on tp8pp1cp8 takes 2.9 s on 64 GPUs
    (189 GPU-seconds), on tp8pp1cp4 5.0 s on 32 (161), the other 96 running bulk work."""
    N = cluster.num_gpus
    reps = [ReplicaCost.of(cost, g, N) for g in configs]
    sizes = np.array([g.num_gpus for g in configs])
    out = []
    for b, schedule in zip(sample, schedules, strict=False):
        try:
            budget = lower_bound(b, cost, N)
        except HydraulisError:  # no config holds the sample's longest: no shape holds it either
            continue
        s, trips = _longest_trips(reps, b, tops)
        work = np.where(trips <= budget, sizes * trips, np.inf)
        for k in (t for t in tops if t < len(b)):
            fill = _bulk_config(schedule.phases, int(s[k - 1]))
            shape = _least_gpu_time(work[:k], sizes, N, fill.num_gpus) if fill is not None else []
            if shape:
                chosen = [configs[j] for j in shape] + [fill] * ((N - int(sizes[shape].sum())) // fill.num_gpus)
                if d := place(sorted(chosen, key=lambda g: -g.num_gpus), cluster):
                    out.append(d)
    return unique_deployments(out)


def _bulk_config(plans: Sequence[IterationPlan], below: int) -> ParallelConfig | None:
    """The config that runs the most tokens of sequences shorter than `below` in these plans (a schedule's
    phases): the bulk's, whose replicas run the next sequences beside a long phase's longest."""
    tokens: dict[ParallelConfig, int] = {}
    for plan in plans:
        for r, replica in enumerate(plan.deployment.replicas):
            held = np.concatenate([np.zeros(0, dtype=np.int64), *plan.micro_batch_lengths(r)])
            tokens[replica.config] = tokens.get(replica.config, 0) + int(held[held < below].sum())
    return max(tokens, key=lambda g: tokens[g]) if tokens and max(tokens.values()) > 0 else None


def _least_gpu_time(work: np.ndarray, sizes: np.ndarray, num_gpus: int, fill: int) -> list[int]:
    """Config indices, one per row of `work` [sequences, configs] (GPU-seconds, inf where not allowed), of the
    least total work on at most `num_gpus` GPUs whose rest `fill` divides (a dynamic programme over the GPUs
    used, vectorised over them); [] where none."""
    least = np.full(num_gpus + 1, np.inf)
    least[0] = 0.0
    back = np.full((len(work), num_gpus + 1, 2), -1)  # (config, GPUs used before) per sequence and GPUs used after
    for i, row in enumerate(work):
        nxt = np.full(num_gpus + 1, np.inf)
        for j in np.flatnonzero(np.isfinite(row)):
            used = np.arange(num_gpus + 1 - sizes[j])
            to, total = used + sizes[j], least[used] + row[j]
            better = total < nxt[to]
            nxt[to[better]] = total[better]
            back[i, to[better]] = np.stack([np.full(better.sum(), j), used[better]], axis=1)
        least = nxt
    ends = [u for u in np.flatnonzero(np.isfinite(least)) if (num_gpus - u) % fill == 0]
    if not ends:
        return []
    u = min(ends, key=lambda e: least[e])
    shape = []
    for i in range(len(work) - 1, -1, -1):
        shape.append(int(back[i, u, 0]))
        u = int(back[i, u, 1])
    return shape[::-1]


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
    memo: dict | None = None,
) -> tuple[list[Deployment], list]:
    """Add the move (a deployment, or hotspa's that pay together) that most lowers the samples' phased
    iterations, while the pool has room.

    Each candidate's planner plans the samples and their short cuts once; the pool's own short-cut
    times depend only on the level, so each round plans them once per level, not once per candidate."""
    memo = {} if memo is None else memo  # every trial plans the samples on the current pool's again: once is enough
    planner = trial_planner(cost, num_gpus, current, memo)
    schedules = [planner.schedule(b) for b in sample]
    while len(current) < max_pool:
        left = ((tuple(d for d in m if d not in current), level, clip) for m, level, clip in moves)
        moves = [(m, level, clip) for m, level, clip in left if m and len(current) + len(m) <= max_pool]
        if not moves:
            break
        base = float(sum(s.iteration_time_s for s in schedules))
        cuts = [_short_cuts(sample, level, clip) for _, level, clip in moves]
        # The sample batches on the cores, and where there are more cores, parts of the moves too (`fan_out_grid`):
        # a memo's plans are of one batch (or its cut), which the trials of every move share, and the next rounds'
        # too (the workers' come back into the memo). Each move's planner is built here, once: a worker plans its
        # share on the ones it inherits.
        pools = [trial_planner(cost, num_gpus, [*current, *m], memo) for m, _, _ in moves]
        trials = functools.partial(_sample_trials, planner=planner, trials=pools, moves=moves, cuts=cuts,
                                   sample=sample)
        per_sample = fan_out_grid(trials, range(len(sample)), len(moves), memo=worker_memo(cost, memo))
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
        planner = trial_planner(cost, num_gpus, current, memo)
        # one that did not pay beside a smaller pool is not tried again (the lazy greedy: a pool that grows
        # leaves each deployment less to save)
        moves = [m for i, m in enumerate(moves) if i != k and gains[i] > min_gain * base]
    return current, schedules


def _sample_trials(
    j: int, which: range, planner: PhasedPlanner, trials: list[PhasedPlanner], moves: list[Move],
    cuts: list[dict[int, np.ndarray]], sample: list[np.ndarray],
) -> list[tuple[Schedule, float, float]]:
    """Sample batch j on the pool with each move of `which` added (`trials`, the pool's planner with each): its
    schedule, and the move's and the current pool's iteration on the batch cut at the move's level (0 where it is
    not cut there; `_short_cuts`)."""
    before: dict[tuple[int, bool], float] = {}  # (level, clip) -> the current pool's iteration on the cut
    out = []
    for (_, level, clip), cut, trial in ((moves[i], cuts[i], trials[i]) for i in which):
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
