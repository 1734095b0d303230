"""Data-aware strategy proposal: generate the deployment pool from the length distribution.

The published generator runs a dynamic programme over (GPUs x length ranges)
once per possible batch maximum length and keeps the distinct deployments.
It scores a range by its total work divided by its replicas, so it misses
what decides real iterations: a long sequence cannot be divided, every
micro-batch pays a fixed cost and a pipeline bubble, caps force extra
micro-batches, and batches differ from each other.

This proposal keeps the programme as a generator of candidates (with the
published and a data-aware group time, see range_dp.py) and adds the
homogeneous deployments and large-plus-small mixes. It then samples global
batches, plans every sample on every promising candidate with the real
planner and simulator, and builds the pool greedily: first the homogeneous
fallback that holds the longest sequence, then, one at a time, the candidate
that most lowers the mean iteration time when the planner picks the best pool
deployment per batch. Diversity follows from that objective: a deployment
enters only if the planner would actually choose it for some batches; its
usage is its share of the samples' tokens as the planner chose, whole or in
phases, and one that ends up with none leaves the pool again. Deployments for
phases, which no whole sample chooses, come last (`phases.phase_deployments`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.errors import HydraulisError
from hydraulis.limits import DEFAULT_MAX_POOL
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.dispatch import NoRoom, dispatch
from hydraulis.planner.phases import PhasedPlanner, phase_deployments
from hydraulis.planner.plan import Schedule
from hydraulis.planner.planner import Planner
from hydraulis.planner.pool import (
    Pool,
    candidate_deployments,
    fallback_config,
    fallback_deployment,
    homogeneous,
    homogeneous_estimate,
    place,
    unique_deployments,
    usable_configs,
)
from hydraulis.planner.range_dp import LengthHistogram, dp_deployments
from hydraulis.planner.replicas import BULK_MIN_SEQUENCES, ReplicaCost, ReplicaTable
from hydraulis.processes.fan_out import fan_out
from hydraulis.specs import ClusterSpec

METHODS = ("hydraulis", "published")
SCREEN_BUDGET_S = 10.0  # CPU seconds of dispatch estimates in the screen (this thread's: load does not move it)
REFINE_FILLS = 6  # cp = 1 configs a refined deployment's GPUs may go to, best alone first
MIN_REFINE = 0.002  # a neighbour must beat the current deployment by this share on the samples
LARGE_BATCH_SCREEN = 4  # dispatch estimates in screening, before the fluid proxy takes over
PROGRESS_EVERY = 6  # candidates planned on the samples between progress reports

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Proposal:
    pool: Pool
    method: str
    candidates: tuple[Deployment, ...]
    times_s: np.ndarray  # [pool deployments, sample batches]: planned iteration time, inf if it cannot hold
    sample_tokens: np.ndarray  # tokens of each sample batch
    elapsed_s: float
    phased_times_s: np.ndarray | None = None  # [sample batches]: the phased planner's iteration on the pool
    tokens_on: np.ndarray | None = None  # [pool deployments, sample batches]: tokens each runs, whole or in phases

    @property
    def best_times_s(self) -> np.ndarray:
        best = self.times_s.min(axis=0)
        return best if self.phased_times_s is None else np.minimum(best, self.phased_times_s)

    @property
    def throughput(self) -> float:
        """Tokens per second over the sample batches, the planner choosing per batch."""
        return float(self.sample_tokens.sum() / self.best_times_s.sum())


def _plan_times(
    cost: CostModel,
    cluster: ClusterSpec,
    candidates: Sequence[Deployment],
    batches: Sequence[np.ndarray],
    progress: Progress | None,
) -> np.ndarray:
    """Planned and simulated iteration time of every batch on every candidate (inf where it cannot hold): the
    batches on the cores (`fan_out`, they are alike in size), a few candidates at a time for progress."""
    columns: list[np.ndarray] = []
    for start in range(0, len(candidates), PROGRESS_EVERY):
        chunk = list(candidates[start : start + PROGRESS_EVERY])
        columns.append(np.array(fan_out(functools.partial(_plan_column, cost, cluster, chunk), batches)).T)
        if progress:
            progress("planning samples", start + len(chunk), len(candidates))
    return np.vstack(columns) if columns else np.zeros((0, len(batches)))


def _plan_column(cost: CostModel, cluster: ClusterSpec, candidates: list[Deployment], batch: np.ndarray) -> list[float]:
    """One batch's planned iteration on each candidate (inf where it cannot hold it)."""
    planner = Planner(cost, cluster.num_gpus, candidates[:1])
    out = []
    for d in candidates:
        out.append(np.inf)
        if int(batch.max()) <= max(cost.lone_cap(c, cluster.num_gpus) for c in d.configs):
            with contextlib.suppress(NoRoom):
                out[-1] = planner.plan_on(batch, d).predicted_time_s
    return out


def _fluid_estimates(
    cost: CostModel,
    cluster: ClusterSpec,
    candidates: Sequence[Deployment],
    batches: Sequence[np.ndarray],
    bins: int = 48,
) -> np.ndarray:
    """A cheap lower-level proxy of dispatch: a small LP per (candidate, batch).

    Sequences are grouped into equal-count length bins that may be split across
    a deployment's config groups; each group's work (with c amortised over
    cap-filled micro-batches) must fit in its replicas times T; T is at least
    the longest bin's trip through its cheapest holding pipeline. Minimising T
    ranks candidates in milliseconds where a real dispatch of a large batch
    takes a quarter of a second.
    """
    from collections import Counter

    from scipy.optimize import linprog
    from scipy.sparse import lil_matrix

    N = cluster.num_gpus
    est = np.full((len(candidates), len(batches)), np.inf)
    reps: dict = {}
    for j, batch in enumerate(batches):
        s = np.sort(np.asarray(batch, dtype=np.int64))
        parts = [p for p in np.array_split(s, min(bins, len(batch))) if len(p)]
        starts = np.cumsum([0] + [len(p) for p in parts[:-1]])
        tokens = np.array([p.sum() for p in parts], dtype=np.float64)
        longest = np.array([p[-1] for p in parts])
        for i, d in enumerate(candidates):
            groups = list(Counter(d.configs).items())
            rows = []
            for g, _ in groups:
                r = reps.setdefault(g, ReplicaCost.of(cost, g, N))
                w = r.seq_costs(s)  # under the memory policy each length needs
                work = np.add.reduceat(w, starts) + r.c * tokens / max(r.cap, 1)
                trip = g.pp * (w[starts + np.array([len(p) for p in parts]) - 1] + r.c)
                rows.append((work, trip, r.holds >= longest))
            fits = np.array([r[2] for r in rows])  # [groups, bins]
            if not fits.any(axis=0).all():
                continue
            floor = float(np.max(np.min(np.where(fits, np.array([r[1] for r in rows]), np.inf), axis=0)))
            pairs = [(gi, k) for gi in range(len(groups)) for k in range(len(parts)) if fits[gi, k]]
            n_var = len(pairs) + 1
            a_ub = lil_matrix((len(groups), n_var))
            a_eq = lil_matrix((len(parts), n_var))
            for v, (gi, k) in enumerate(pairs):
                a_ub[gi, v] = rows[gi][0][k]
                a_eq[k, v] = 1.0
            for gi, (_, replicas) in enumerate(groups):
                a_ub[gi, n_var - 1] = -float(replicas)
            objective = np.zeros(n_var)
            objective[-1] = 1.0
            res = linprog(
                objective,
                A_ub=a_ub.tocsr(),
                b_ub=np.zeros(len(groups)),
                A_eq=a_eq.tocsr(),
                b_eq=np.ones(len(parts)),
                bounds=(0, None),
                method="highs",
            )
            if res.status == 0:
                est[i, j] = max(float(res.fun), floor)
    return est


def _screen(
    cost: CostModel, cluster: ClusterSpec, candidates: Sequence[Deployment], batches: Sequence[np.ndarray], keep: int
) -> list[int]:
    """Successive halving on cheap dispatch estimates: the candidates best on average, and the best per batch.

    Each round estimates the surviving candidates on one more batch and keeps
    the better half (at least 2 x keep), so most candidates cost one estimate.
    """
    est = np.full((len(candidates), len(batches)), np.nan)
    tables = [ReplicaTable.of(cost, d, cluster.num_gpus) for d in candidates]
    alive = np.arange(len(candidates))
    # Large batches make each dispatch slow: past a budget, a fluid LP proxy picks whom to dispatch. The call is
    # timed in this thread's CPU time, not wall time: other processes' load would otherwise change the pool.
    start = time.thread_time()
    with contextlib.suppress(NoRoom):  # timing one call: whether it finds room does not matter
        dispatch(batches[0], tables[0], search=False)
    per_call = time.thread_time() - start
    affordable = int(SCREEN_BUDGET_S / max(per_call, 1e-6) / 2)
    if len(alive) > max(affordable, 3 * keep):
        fluid = _fluid_estimates(cost, cluster, candidates, batches)
        ratio = fluid / np.min(fluid, axis=0, keepdims=True)
        score = np.where(np.isfinite(ratio), ratio, 10.0).mean(axis=1)
        alive = np.argsort(score, kind="stable")[: max(affordable, 3 * keep)]
    for j, b in enumerate(batches):
        est[alive, j] = fan_out(functools.partial(_makespan, b), [tables[i] for i in alive])
        seen = est[:, : j + 1]
        ratio = seen / np.nanmin(seen, axis=0, keepdims=True)
        # Mean ratio to the best over the batches a candidate was estimated on; unusable ones rank last.
        score = np.where(np.isnan(ratio), 10.0, ratio)[alive].mean(axis=1)
        alive = alive[np.argsort(score, kind="stable")]
        if j < len(batches) - 1:
            alive = alive[: max(2 * keep, -(-len(alive) // 2))]
    chosen = set(int(i) for i in alive[:keep])
    for j in range(len(batches)):
        column = np.where(np.isnan(est[:, j]), np.inf, est[:, j])
        if np.isfinite(column).any():
            chosen.add(int(np.argmin(column)))
    return sorted(chosen)


def _dp_candidates(cost: CostModel, cluster: ClusterSpec, hist: LengthHistogram, aware: bool) -> list[Deployment]:
    """The range programme's deployments, with the data-aware group time or the published one."""
    return [d for _, d in dp_deployments(cost, cluster, hist, aware=aware)]


def _makespan(batch: np.ndarray, table: ReplicaTable) -> float:
    """The screen's dispatch estimate of `batch` on a deployment (nan where it cannot hold it)."""
    if int(table.lone_cap.max()) >= int(batch.max()):
        with contextlib.suppress(NoRoom):  # lone micro-batches for fewer long sequences than it has
            return dispatch(batch, table, search=False).makespan_s
    return np.nan


def neighbours(
    cost: CostModel, cluster: ClusterSpec, d: Deployment, fills: Sequence[ParallelConfig], longest: int
) -> list[Deployment]:
    """Deployments one step from `d` that still hold `longest`: a replica of a group given to another group,
    a group's GPUs given to another config of `fills`, or one replica's GPUs to replicas of a `fills` config.
    The candidates' fixed shapes (k large replicas beside small ones of the best few configs) miss the best mix
    where the best small config ranks low alone (7b-32g-code: 3x tp2pp1cp4 + 4x tp2pp1, 3% below 4x tp2pp1cp4)."""
    N = cluster.num_gpus
    groups = Counter(d.configs)
    out: list[list[ParallelConfig]] = []

    def spread(base: Counter, gpus: int, g: ParallelConfig) -> None:
        if gpus > 0 and gpus % g.num_gpus == 0:
            out.append([h for h, n in (base + Counter({g: gpus // g.num_gpus})).items() for _ in range(n)])

    for g, n in groups.items():
        rest = groups - Counter({g: n})
        for h in fills:  # the group's GPUs to another config, or one replica's GPUs beside n - 1 of them
            if h != g:
                spread(rest, n * g.num_gpus, h)
                spread(rest + Counter({g: n - 1}), g.num_gpus, h)
        for h, m in rest.items():  # one more replica of g, taken from h's GPUs
            if g.num_gpus % h.num_gpus == 0 and m > g.num_gpus // h.num_gpus:
                moved = groups + Counter({g: 1}) - Counter({h: g.num_gpus // h.num_gpus})
                out.append([x for x, k in moved.items() for _ in range(k)])
    found = []
    for configs in out:
        if (sum(g.num_gpus for g in configs) == N and max(cost.lone_cap(g, N) for g in configs) >= longest
                and (placed := place(sorted(configs, key=lambda g: -cost.lone_cap(g, N)), cluster)) is not None):
            found.append(placed)
    return unique_deployments(found)


def refine(
    cost: CostModel,
    cluster: ClusterSpec,
    candidates: list[Deployment],
    times: np.ndarray,
    batches: Sequence[np.ndarray],
    longest: int,
    budget: int,
) -> tuple[list[Deployment], np.ndarray]:
    """A local search from the candidate planned fastest on the samples: its neighbours (`neighbours`) planned,
    the best taken while it beats the current by MIN_REFINE, at most `budget` of them (a count, not seconds: the
    pool must not move with the machine's load). Every deployment planned joins the candidates (the pool's
    greedy may want one for some batches)."""
    N = cluster.num_gpus
    fills = [g for g in usable_configs(cost, cluster) if g.cp == 1]
    fills = sorted(fills, key=lambda g: homogeneous_estimate(cost, g, N, [b[b <= cost.cap(g, N)] for b in batches]))
    fills = fills[:REFINE_FILLS] + [g for g in dict.fromkeys(c for d in candidates for c in d.configs) if g.cp > 1]
    seen = {str(d) for d in candidates}
    current, left = int(np.argmin(np.where(np.isfinite(times), times, 1e30).sum(axis=1))), budget
    while left > 0:
        fresh = [d for d in neighbours(cost, cluster, candidates[current], fills, longest) if str(d) not in seen]
        fresh, left = fresh[:left], left - len(fresh[:left])
        if not fresh:
            break
        seen.update(str(d) for d in fresh)
        candidates, times = [*candidates, *fresh], np.vstack([times, _plan_times(cost, cluster, fresh, batches, None)])
        totals = np.where(np.isfinite(times), times, 1e30).sum(axis=1)
        best = int(np.argmin(totals))
        if totals[best] >= totals[current] * (1 - MIN_REFINE):
            break
        current = best
    return candidates, times


def greedy_pool(times: np.ndarray, first: int, max_pool: int, min_gain: float = 0.002) -> list[int]:
    """Row indices: `first`, then the rows that most lower sum over batches of the row-wise minimum."""
    chosen = [first]
    best = times[first].copy()
    while len(chosen) < max_pool:
        gain = np.where(np.isfinite(best), best, 1e30)[None, :] - np.minimum(times, best[None, :])
        gain = np.where(np.isfinite(gain), gain, 0.0).sum(axis=1)
        gain[chosen] = -np.inf
        k = int(np.argmax(gain))
        if gain[k] <= min_gain * float(best[np.isfinite(best)].sum()):
            break
        chosen.append(k)
        best = np.minimum(best, times[k])
    return chosen


def default_samples(batches: Sequence[np.ndarray]) -> int:
    """Planning cost grows with the batch: fewer samples for larger jobs keep proposal within a minute."""
    tokens = float(np.mean([b.sum() for b in batches]))
    return int(np.clip(4e6 / max(tokens, 1.0), 4, 16))


def _published(
    cost: CostModel, cluster: ClusterSpec, hist: LengthHistogram, fallback: Deployment, max_pool: int
) -> list[Deployment]:
    """The published generator's pool: one deployment per batch maximum length, the fallback first."""
    found = unique_deployments([fallback] + [d for _, d in dp_deployments(cost, cluster, hist, aware=False)])
    if len(found) > max_pool:
        # One deployment per batch maximum length; keep the fallback and evenly spread maxima.
        keep = np.unique(np.linspace(1, len(found) - 1, max_pool - 1).round().astype(int))
        found = [found[0]] + [found[i] for i in keep]
    return found


def _fallback(
    method: str, cost: CostModel, cluster: ClusterSpec, longest: int, batches: Sequence[np.ndarray]
) -> Deployment:
    """The pool's first deployment, which holds `longest`. The published system knows no lone micro-batches:
    its fallback holds the longest sequence by the cap."""
    if method == "hydraulis":
        return fallback_deployment(cost, cluster, longest, batches)
    return homogeneous(fallback_config(cost, cluster, longest, batches, lone=False), cluster)


def propose(
    cost: CostModel,
    cluster: ClusterSpec,
    batches: Sequence[np.ndarray],
    max_pool: int = DEFAULT_MAX_POOL,
    method: str = "hydraulis",
    max_samples: int | None = None,
    screen: int = 10,
    max_length: int | None = None,
    progress: Progress | None = None,
) -> Proposal:
    """Propose a pool of at most `max_pool` deployments for batches like `batches`; the fallback holds
    `max_length` (default: the longest sampled sequence)."""
    start = time.perf_counter()
    if method not in METHODS:
        raise HydraulisError(f"unknown proposal method {method!r}; use one of {', '.join(METHODS)}")
    if max_pool < 1:
        raise HydraulisError(f"--max-pool must be at least 1, got {max_pool}")
    batches = [np.asarray(b, dtype=np.int64) for b in batches if len(b)]
    if not batches:
        raise HydraulisError("cannot propose a pool without sample batches")
    hist = LengthHistogram.from_batches(batches)
    longest = max(hist.max_length, max_length or 0)
    fallback = _fallback(method, cost, cluster, longest, batches)
    sample = batches[: max_samples or default_samples(batches)]

    if method == "published":
        candidates = _published(cost, cluster, hist, fallback, max_pool)
        times = _plan_times(cost, cluster, candidates, sample, progress)
        pool_idx = list(range(len(candidates)))
    else:
        aware, published = fan_out(functools.partial(_dp_candidates, cost, cluster, hist), [True, False])
        every = candidates = unique_deployments(
            [fallback] + aware + published + candidate_deployments(cost, cluster, longest, sample[:4])
        )
        if np.mean([len(b) for b in sample]) >= BULK_MIN_SEQUENCES:
            # Large batches of light sequences: the dispatch estimate ranks as planning would, and each
            # planned candidate costs seconds, so fewer survive the screen.
            screen = min(screen, LARGE_BATCH_SCREEN)
        kept = _screen(cost, cluster, candidates, sample, screen)  # sorted: the fallback first where kept
        candidates = [candidates[i] for i in dict.fromkeys([0, *kept])]
        times_all = _plan_times(cost, cluster, candidates, sample, progress)
        candidates, times_all = refine(cost=cost, cluster=cluster, candidates=candidates, times=times_all,
                                       batches=sample, longest=longest, budget=len(candidates))
        pool_idx = greedy_pool(times_all, 0, max_pool)
        times = times_all[pool_idx]
    pool_deployments = tuple(candidates[i] for i in pool_idx)
    sample_tokens = np.array([float(b.sum()) for b in sample])
    tokens_on = np.eye(len(pool_deployments))[np.argmin(times, axis=0)].T * sample_tokens  # whole, on the fastest
    phased = None
    if method == "hydraulis" and max_pool > 1:
        # The whole-batch choices compete with the phases' for the pool's room, on the phased planner's time.
        extra, schedules = phase_deployments(cost, cluster, every, pool_deployments[:1], sample, max_pool=max_pool,
                                             whole=pool_deployments[1:])
        pool_deployments, schedules = _without_idle(cost, cluster, (pool_deployments[0], *extra), schedules, sample)
        phased = np.array([s.iteration_time_s for s in schedules])
        tokens_on = tokens_per_deployment(pool_deployments, schedules)
        rows = {str(d): times_all[k] for k, d in enumerate(candidates)}
        times = np.array([rows.get(str(d), np.full(len(sample), np.inf)) for d in pool_deployments])
    usage = tuple(float(t) for t in tokens_on.sum(axis=1) / tokens_on.sum())
    return Proposal(
        pool=Pool(cost.name, cluster, pool_deployments, usage),
        method=method,
        candidates=tuple(candidates),
        times_s=times,
        sample_tokens=sample_tokens,
        elapsed_s=time.perf_counter() - start,
        phased_times_s=phased,
        tokens_on=tokens_on,
    )


def tokens_per_deployment(pool: Sequence[Deployment], schedules: Sequence[Schedule]) -> np.ndarray:
    """[pool deployments, batches]: the tokens of each batch each deployment runs (whole, or in its phases)."""
    out = np.zeros((len(pool), len(schedules)))
    for j, schedule in enumerate(schedules):
        for plan in schedule.phases:
            out[pool.index(plan.deployment), j] += plan.num_tokens
    return out


def _without_idle(
    cost: CostModel, cluster: ClusterSpec, pool: tuple[Deployment, ...], schedules: list[Schedule],
    sample: Sequence[np.ndarray],
) -> tuple[tuple[Deployment, ...], list[Schedule]]:
    """The pool less the deployments, but the fallback, that run no sample's tokens (later ones took theirs over),
    the samples planned again, where no slower: the phased planner cuts batches at the pool's caps."""
    used = {str(plan.deployment) for s in schedules for plan in s.phases}
    kept = tuple(d for k, d in enumerate(pool) if k == 0 or str(d) in used)
    if len(kept) == len(pool):
        return pool, schedules
    planner = PhasedPlanner(cost, cluster.num_gpus, list(kept))
    again = [planner.schedule(b) for b in sample]
    if sum(s.iteration_time_s for s in again) <= sum(s.iteration_time_s for s in schedules) * (1 + 1e-9):
        return kept, again
    return pool, schedules
