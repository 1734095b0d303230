"""The proposal's screens: cheap dispatch estimates that pick which candidates to plan, and planning them.

Planning a sample batch on a candidate costs up to seconds, so most candidates
are judged by estimates first: the dispatch's makespan in successive halving,
and for large batches a fluid LP proxy before that.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.parallel import Deployment
from hydraulis.planner.dispatch import NoRoom, dispatch
from hydraulis.planner.planner import Planner
from hydraulis.planner.replicas import ReplicaCost, ReplicaTable
from hydraulis.processes.fan_out import fan_out, fan_out_grid
from hydraulis.specs import ClusterSpec

# sequences the screen's dispatch estimates place (about 10 s here: on the bench's samples of 41-3,910 sequences a
# dispatch takes 1.3-7.2 us a sequence); a count, not a timed call, so the pool does not move with the machine or load
SCREEN_SEQUENCES = 5_000_000
LARGE_BATCH_SCREEN = 4  # dispatch estimates in screening, before the fluid proxy takes over
PROGRESS_EVERY = 6  # candidates planned on the samples between progress reports

Progress = Callable[[str, int, int], None]


def plan_times(
    cost: CostModel,
    cluster: ClusterSpec,
    candidates: Sequence[Deployment],
    batches: Sequence[np.ndarray],
    progress: Progress | None,
    memo: dict | None = None,
) -> np.ndarray:
    """Planned and simulated iteration time of every batch on every candidate (inf where it cannot hold): the
    batches on the cores, and where there are more cores, parts of the candidates too (`fan_out_grid`; batches
    alike in size), a few candidates at a time for progress. `memo`: the planner's memo (`Planner(memo=)`) the plans
    go to, workers' included, for later planners of `cost` on pools with these candidates (the phases' greedy plans
    the samples whole on each again)."""
    columns: list[np.ndarray] = []
    for start in range(0, len(candidates), PROGRESS_EVERY):
        chunk = list(candidates[start : start + PROGRESS_EVERY])
        column = functools.partial(_plan_column, cost, cluster, chunk, memo)
        columns.append(np.array(fan_out_grid(column, batches, len(chunk), memo=worker_memo(cost, memo))).T)
        if progress:
            progress("planning samples", start + len(chunk), len(candidates))
    return np.vstack(columns) if columns else np.zeros((0, len(batches)))


def worker_memo(cost: CostModel, memo: dict | None = None) -> dict:
    """`memo` (a new one by default) for `fan_out` with the caps of `cost` and of its later phases in it
    (`CostModel.cap_cache`): the caps a forked worker's plans find, a search each, come back to this process
    with the plans, so that the next round's workers and the run's planner find them."""
    memo = {} if memo is None else memo
    memo["caps"], memo["later caps"] = cost.cap_cache(), cost.later_phase().cap_cache()
    return memo


def _plan_column(
    cost: CostModel, cluster: ClusterSpec, candidates: list[Deployment], memo: dict | None, batch: np.ndarray,
    which: range,
) -> list[float]:
    """One batch's planned iteration on each candidate of `which` (inf where it cannot hold it). With a memo, each
    candidate as a pool deployment: `plan_on` then packs it as the pool's screen does (`Planner._packed`, the same
    candidate as without, whatever else the pool holds), once per memo."""
    candidates = [candidates[i] for i in which]
    planner = Planner(cost, cluster.num_gpus, candidates if memo is not None else candidates[:1], memo=memo)
    out = []
    for d in candidates:
        out.append(np.inf)
        if int(batch.max()) <= max(cost.lone_cap(c, cluster.num_gpus) for c in d.configs):
            with contextlib.suppress(NoRoom):
                out[-1] = planner.plan_on(batch, d).predicted_time_s
    return out


def fluid_estimates(
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


def screen_candidates(
    cost: CostModel, cluster: ClusterSpec, candidates: Sequence[Deployment], batches: Sequence[np.ndarray], keep: int
) -> list[int]:
    """Successive halving on cheap dispatch estimates: the candidates best on average, and the best per batch.

    Each round estimates the surviving candidates on one more batch and keeps
    the better half (at least 2 x keep), so most candidates cost one estimate.
    """
    est = np.full((len(candidates), len(batches)), np.nan)
    tables = [ReplicaTable.of(cost, d, cluster.num_gpus) for d in candidates]
    alive = np.arange(len(candidates))
    # Large batches make each dispatch slow (its time grows with the sequences): past a budget, a fluid LP proxy
    # picks whom to dispatch. Halving, the rounds dispatch about twice the first's.
    affordable = SCREEN_SEQUENCES // (2 * max(len(batches[0]), 1))
    if len(alive) > max(affordable, 3 * keep):
        fluid = fluid_estimates(cost, cluster, candidates, batches)
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


def _makespan(batch: np.ndarray, table: ReplicaTable) -> float:
    """The screen's dispatch estimate of `batch` on a deployment (nan where it cannot hold it)."""
    if int(table.lone_cap.max()) >= int(batch.max()):
        with contextlib.suppress(NoRoom):  # lone micro-batches for fewer long sequences than it has
            return dispatch(batch, table, search=False).makespan_s
    return np.nan
