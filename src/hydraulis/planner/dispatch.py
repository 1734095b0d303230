"""Stage 1: dispatch every sequence of a global batch to a replica.

Objective: the slowest replica's 1F1B time, estimated from its sequences as in
`replicas.estimate_time` (so dispatch already pays for c per micro-batch and the
(pp - 1) x largest bubble that packing will produce).

Heuristic (default): longest first, each sequence to the replica that would
finish earliest with it among those whose cap holds it (identical replicas share
a heap, so a step costs one estimate per distinct config); then local search off
the bottleneck replica, moves and swaps, evaluated for all candidates at once
with numpy. A replica that would only slow the iteration down stays empty.

Exact (option, and the test oracle): one MILP over sequences x replicas x
micro-batch slots with the closed-form objective sum t + (pp - 1) * max t,
warm-started from the heuristic's plan and time-limited.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.planner.milp import solve_milp
from hydraulis.planner.replicas import BULK_MIN_SEQUENCES, HEAVY_SHARE, ReplicaTable, estimate_time


@dataclass(frozen=True)
class Dispatch:
    replica_of: np.ndarray  # [sequences] replica index
    estimate_s: np.ndarray  # [replicas] estimated 1F1B time (bias included)

    @property
    def makespan_s(self) -> float:
        return float(self.estimate_s.max()) if len(self.estimate_s) else 0.0

    def members(self, replica: int) -> np.ndarray:
        return np.flatnonzero(self.replica_of == replica)

    def all_members(self) -> list[np.ndarray]:
        """`members(r)` for every replica, in one sort instead of one scan per replica."""
        order = np.argsort(self.replica_of, kind="stable")
        counts = np.bincount(self.replica_of, minlength=len(self.estimate_s))
        return np.split(order, np.cumsum(counts)[:-1])


@dataclass
class _Sums:
    """Running sums per replica; the inputs of the estimate."""

    W: np.ndarray
    T: np.ndarray
    n: np.ndarray
    wmax: np.ndarray

    @classmethod
    def of(cls, lengths: np.ndarray, w_seq: np.ndarray, replica_of: np.ndarray, R: int) -> _Sums:
        wmax = np.zeros(R)
        np.maximum.at(wmax, replica_of, w_seq)
        return cls(
            np.bincount(replica_of, weights=w_seq, minlength=R),
            np.bincount(replica_of, weights=lengths, minlength=R).astype(np.int64),
            np.bincount(replica_of, minlength=R),
            wmax,
        )


def _scalar_estimate(W: float, T: int, n: int, wmax: float, c: float, pp1: int, cap: int, me: int) -> float:
    """`estimate_time` for one replica in plain Python: the greedy's inner loop."""
    if n == 0:
        return 0.0
    vmin = max(1, -(-T // cap))
    if pp1 == 0:
        return W + vmin * c
    vmax = max(vmin, min(n, T // max(me, 1)))
    v = math.floor(math.sqrt(pp1 * W / max(c, 1e-12)))  # c = 0: as many micro-batches as allowed
    best = math.inf
    for u in (min(max(v, vmin), vmax), min(max(v + 1, vmin), vmax)):
        best = min(best, W + u * c + pp1 * (max(W / u, wmax) + c))
    return best


BULK_RUNS = 128  # slices of the light tail that are water-filled at once


def greedy_dispatch(lengths: np.ndarray, table: ReplicaTable, bias: np.ndarray | None = None) -> np.ndarray:
    """Longest first to the replica that finishes earliest with it (cap permitting).

    In a large batch only the heavy head goes one by one; the light tail (each
    sequence a small share of a replica's load) is water-filled in runs, which
    keeps the greedy O(n log n) in numpy instead of O(n) steps of Python.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    R = len(table)
    bias_a = np.zeros(R) if bias is None else np.asarray(bias, dtype=np.float64)
    bias_l = bias_a.tolist()
    w_arr = table.cost_matrix(lengths)
    order_a = np.argsort(-lengths, kind="stable")
    head = len(lengths)
    if len(lengths) >= BULK_MIN_SEQUENCES:
        w0 = w_arr[0][order_a]
        fair = float(w0.sum()) / R
        head = int(np.searchsorted(-w0, -fair * HEAVY_SHARE, side="left"))
    w = w_arr[:, order_a[:head]].tolist() if head < len(lengths) else w_arr.tolist()
    order = order_a[:head].tolist()
    positions = range(head) if head < len(lengths) else order
    L = lengths.tolist()
    groups = range(len(table.configs))
    heaps: list[list[tuple[float, int]]] = [[] for _ in groups]
    for r in range(R):
        heaps[int(table.group[r])].append((bias_l[r], r))
    for h in heaps:
        heapq.heapify(h)
    params = [(m.c, m.pp - 1, m.cap, m.min_efficient) for m in table.configs]
    W = [0.0] * R
    T = [0] * R
    n = [0] * R
    wmax = [0.0] * R
    out = [0] * len(L)
    for i, p in zip(order, positions, strict=True):
        s = L[i]
        best, best_g, best_r = math.inf, -1, -1
        for g in groups:
            c, pp1, cap, me = params[g]
            if cap < s:
                continue
            r = heaps[g][0][1]
            wi = w[g][p]
            if pp1 == 0:  # the common case, inlined: W + c * ceil(T / cap)
                T_new = T[r] + s
                e = W[r] + wi + c * max(1, -(-T_new // cap)) + bias_l[r]
            else:
                e = _scalar_estimate(W[r] + wi, T[r] + s, n[r] + 1, max(wmax[r], wi), c, pp1, cap, me) + bias_l[r]
            if e < best:
                best, best_g, best_r = e, g, r
        if best_g < 0:
            raise ValueError(f"no replica holds a sequence of {s} tokens")  # callers check caps first
        wi = w[best_g][p]
        W[best_r] += wi
        T[best_r] += s
        n[best_r] += 1
        if wi > wmax[best_r]:
            wmax[best_r] = wi
        heapq.heapreplace(heaps[best_g], (best, best_r))
        out[i] = best_r
    replica_of = np.array(out, dtype=np.int64)
    if head < len(lengths):
        sums = _Sums(np.array(W), np.array(T, dtype=np.int64), np.array(n, dtype=np.int64), np.array(wmax))
        _water_fill(lengths, w_arr, order_a[head:], table, bias_a, sums, replica_of)
    return replica_of


def _water_fill(
    lengths: np.ndarray,
    w: np.ndarray,
    tail: np.ndarray,
    table: ReplicaTable,
    bias: np.ndarray,
    sums: _Sums,
    replica_of: np.ndarray,
) -> None:
    """Light sequences (longest first, in runs) to replicas, each run raising the least loaded to one level.

    Within a run every replica's estimate is taken as linear in the count it
    receives (slope from a probe of the run's fair share), the common level is
    solved exactly, and counts are rounded so that the run is placed whole.
    Caps hold: a run only goes to replicas whose cap holds its longest sequence.
    """
    group = table.group
    p = (table.c, table.pp, table.cap, table.min_efficient)
    for run in np.array_split(tail, min(BULK_RUNS, len(tail))):
        m = len(run)
        if m == 0:
            continue
        s_run = lengths[run]
        w_run = w[:, run]  # [configs, m]
        ok = np.flatnonzero(table.cap >= int(s_run[0]))
        if len(ok) == 0:
            raise ValueError(f"no replica holds a sequence of {int(s_run[0])} tokens")  # callers check caps first
        g = group[ok]
        wbar, sbar = w_run.mean(axis=1)[g], float(s_run.mean())
        e0 = estimate_time(sums.W[ok], sums.T[ok], sums.n[ok], sums.wmax[ok], *(x[ok] for x in p)) + bias[ok]
        probe = max(1, -(-m // len(ok)))
        e1 = (
            estimate_time(
                sums.W[ok] + probe * wbar,
                sums.T[ok] + probe * sbar,
                sums.n[ok] + probe,
                np.maximum(sums.wmax[ok], w_run[g, 0]),
                *(x[ok] for x in p),
            )
            + bias[ok]
        )
        slope = np.maximum((e1 - e0) / probe, 1e-15)
        counts = _level_counts(e0, slope, m)
        # The least loaded replicas take the longest of the run.
        rank = np.argsort(e0, kind="stable")
        takers = ok[rank]
        per = counts[rank]
        dest = np.repeat(takers, per)
        replica_of[run] = dest
        w_own = w_run[group[dest], np.arange(m)]
        R = len(table)
        sums.W += np.bincount(dest, weights=w_own, minlength=R)
        sums.T += np.bincount(dest, weights=s_run, minlength=R).astype(np.int64)
        sums.n += np.bincount(dest, minlength=R)
        np.maximum.at(sums.wmax, dest, w_own)


def _level_counts(e0: np.ndarray, slope: np.ndarray, m: int) -> np.ndarray:
    """Integer counts k >= 0 summing to m that bring e0 + k * slope to one level (the lowest possible)."""
    order = np.argsort(e0, kind="stable")
    e, inv = e0[order], 1.0 / slope[order]
    # With the j lowest replicas active, the level is (m + sum e/slope) / sum 1/slope; the first j whose
    # level does not reach the next replica's start is the answer.
    level = (m + np.cumsum(e * inv)) / np.cumsum(inv)
    nxt = np.r_[e[1:], np.inf]
    j = int(np.argmax(level <= nxt))
    lam = level[j]
    k = np.floor(np.maximum(lam - e0, 0.0) / slope).astype(np.int64)
    short = m - int(k.sum())
    after = e0 + (k + 1) * slope
    if short > 0:  # the rounding's remainder to those who stay lowest with one more
        k[np.argsort(after, kind="stable")[:short]] += 1
    elif short < 0:
        top = np.argsort(-(e0 + k * slope), kind="stable")
        for r in top.tolist():
            if short == 0:
                break
            if k[r] > 0:
                k[r] -= 1
                short += 1
    return k


def _estimates(
    sums: _Sums, table: ReplicaTable, bias: np.ndarray, rows: np.ndarray | slice = slice(None)
) -> np.ndarray:
    return (
        estimate_time(
            sums.W[rows],
            sums.T[rows],
            sums.n[rows],
            sums.wmax[rows],
            table.c[rows],
            table.pp[rows],
            table.cap[rows],
            table.min_efficient[rows],
        )
        + bias[rows]
    )


def _without_each(w_items: np.ndarray) -> np.ndarray:
    """Largest of the other items, for each item (the replica's w_max once it leaves)."""
    if len(w_items) == 1:
        return np.zeros(1)
    top2 = np.partition(w_items, -2)[-2:]
    first, second = top2.max(), top2.min()
    return np.where(w_items >= first, second, first)


def local_search(
    lengths: np.ndarray,
    table: ReplicaTable,
    replica_of: np.ndarray,
    bias: np.ndarray | None = None,
    max_rounds: int | None = None,
    swap_partners: int = 4,
    rel_tol: float = 1e-4,
    targets_per_config: int = 8,
) -> np.ndarray:
    """Move or swap sequences off the bottleneck replica while that lowers it below its current time.

    After a water-filled greedy (large batches) the bottleneck is within a light
    sequence of the others, so fewer rounds are worth their cost there.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if max_rounds is None:
        max_rounds = 100 if len(lengths) < BULK_MIN_SEQUENCES else 16
    R = len(table)
    bias = np.zeros(R) if bias is None else np.asarray(bias, dtype=np.float64)
    replica_of = replica_of.copy()
    wg = table.cost_matrix(lengths)  # [configs, n]
    group = table.group
    w_own = wg[group[replica_of], np.arange(len(lengths))]
    sums = _Sums.of(lengths, w_own, replica_of, R)
    est = _estimates(sums, table, bias)
    p = (table.c, table.pp, table.cap, table.min_efficient)
    for _ in range(max_rounds):
        b = int(np.argmax(est))
        top = est[b]
        tol = rel_tol * top
        items = np.flatnonzero(replica_of == b)
        if len(items) == 0:
            break
        w_bk = wg[group[b], items]
        wmax_wo = _without_each(w_bk)
        keep = representatives(lengths[items])
        items, w_bk, wmax_wo = items[keep], w_bk[keep], wmax_wo[keep]
        s_k = lengths[items]
        e_b = estimate_time(sums.W[b] - w_bk, sums.T[b] - s_k, sums.n[b] - 1, wmax_wo, *(x[b] for x in p)) + bias[b]
        # Moves: every item of b to each of the least loaded replicas of every config, at once.
        cand = _least_loaded(est, group, targets_per_config)
        w_rk = wg[group[cand]][:, items]  # [candidates, k]
        e_r = (
            estimate_time(
                sums.W[cand, None] + w_rk,
                sums.T[cand, None] + s_k[None, :],
                sums.n[cand, None] + 1,
                np.maximum(sums.wmax[cand, None], w_rk),
                *(x[cand, None] for x in p),
            )
            + bias[cand, None]
        )
        e_r[cand == b] = np.inf
        e_r[table.cap[cand, None] < s_k[None, :]] = np.inf
        worst = np.maximum(e_r, e_b[None, :])
        j, k = np.unravel_index(int(np.argmin(worst)), worst.shape)
        r = int(cand[j])
        if worst[j, k] < top - tol:
            _apply(sums, replica_of, lengths, wg, group, items[k], b, r)
            est[[b, r]] = _estimates(sums, table, bias, np.array([b, r]))
            continue
        # Swaps: an item of b against an item of one of the least loaded replicas.
        if not _best_swap(sums, table, bias, est, replica_of, lengths, wg, b, items, w_bk, wmax_wo, swap_partners, tol):
            break
    return replica_of


SEARCH_ITEMS = 384  # distinct lengths per replica that a move or swap considers


def representatives(lengths: np.ndarray, limit: int = SEARCH_ITEMS) -> np.ndarray:
    """Positions of one sequence per distinct length (at most `limit`, spread over the range).

    Sequences of equal length are interchangeable in a move or a swap, so one of
    each loses nothing, and the search costs O(distinct^2), not O(sequences^2).
    """
    _, first = np.unique(lengths, return_index=True)
    if len(first) > limit:
        first = first[np.unique(np.linspace(0, len(first) - 1, limit).round().astype(np.int64))]
    return np.sort(first)


def _least_loaded(est: np.ndarray, group: np.ndarray, per_group: int) -> np.ndarray:
    """Indices of the `per_group` least loaded replicas of each config."""
    if len(est) <= per_group * (int(group.max()) + 1):
        return np.arange(len(est))
    out = []
    for g in np.unique(group):
        members = np.flatnonzero(group == g)
        if len(members) > per_group:
            members = members[np.argpartition(est[members], per_group)[:per_group]]
        out.append(members)
    return np.concatenate(out)


def _apply(sums: _Sums, replica_of, lengths, wg, group, i: int, src: int, dst: int) -> None:
    replica_of[i] = dst
    sums.W[src] -= wg[group[src], i]
    sums.W[dst] += wg[group[dst], i]
    sums.T[src] -= lengths[i]
    sums.T[dst] += lengths[i]
    sums.n[src] -= 1
    sums.n[dst] += 1
    for r in (src, dst):
        members = np.flatnonzero(replica_of == r)
        sums.wmax[r] = wg[group[r], members].max() if len(members) else 0.0


def _best_swap(sums, table, bias, est, replica_of, lengths, wg, b, items, w_bk, wmax_wo, partners, tol) -> bool:
    group = table.group
    top = est[b]
    order = np.argsort(est)
    for r in order[:partners].tolist():
        if r == b:
            continue
        mine = np.flatnonzero(replica_of == r)
        if len(mine) == 0:
            continue
        w_rm = wg[group[r], mine]
        wmax_wo_r = _without_each(w_rm)
        keep = representatives(lengths[mine])
        mine, w_rm, wmax_wo_r = mine[keep], w_rm[keep], wmax_wo_r[keep]
        s_k, s_m = lengths[items], lengths[mine]
        w_bm = wg[group[b], mine]  # r's items costed on b
        w_rk = wg[group[r], items]  # b's items costed on r
        fits_b = table.cap[b] >= s_m
        fits_r = table.cap[r] >= s_k
        pb = [x[b] for x in (table.c, table.pp, table.cap, table.min_efficient)]
        pr = [x[r] for x in (table.c, table.pp, table.cap, table.min_efficient)]
        e_b = (
            estimate_time(
                sums.W[b] - w_bk[:, None] + w_bm[None, :],
                sums.T[b] - s_k[:, None] + s_m[None, :],
                sums.n[b],
                np.maximum(wmax_wo[:, None], w_bm[None, :]),
                *pb,
            )
            + bias[b]
        )
        e_r = (
            estimate_time(
                sums.W[r] - w_rm[None, :] + w_rk[:, None],
                sums.T[r] - s_m[None, :] + s_k[:, None],
                sums.n[r],
                np.maximum(wmax_wo_r[None, :], w_rk[:, None]),
                *pr,
            )
            + bias[r]
        )
        worst = np.maximum(e_b, e_r)
        worst[~fits_r, :] = np.inf
        worst[:, ~fits_b] = np.inf
        k, m = np.unravel_index(int(np.argmin(worst)), worst.shape)
        if worst[k, m] < top - tol:
            _apply(sums, replica_of, lengths, wg, group, items[k], b, r)
            _apply(sums, replica_of, lengths, wg, group, mine[m], r, b)
            est[[b, r]] = _estimates(sums, table, bias, np.array([b, r]))
            return True
    return False


def dispatch(lengths: np.ndarray, table: ReplicaTable, bias: np.ndarray | None = None, search: bool = True) -> Dispatch:
    """The default heuristic: greedy earliest-finish, then (if `search`) local search."""
    lengths = np.asarray(lengths, dtype=np.int64)
    R = len(table)
    bias = np.zeros(R) if bias is None else np.asarray(bias, dtype=np.float64)
    replica_of = greedy_dispatch(lengths, table, bias)
    if search:
        replica_of = local_search(lengths, table, replica_of, bias)
    return Dispatch(replica_of, estimated_times(lengths, table, replica_of, bias))


def improve(lengths: np.ndarray, table: ReplicaTable, d: Dispatch, bias: np.ndarray | None = None) -> Dispatch:
    """Local search on an existing dispatch."""
    replica_of = local_search(lengths, table, d.replica_of, bias)
    return Dispatch(replica_of, estimated_times(lengths, table, replica_of, bias))


def estimated_times(
    lengths: np.ndarray, table: ReplicaTable, replica_of: np.ndarray, bias: np.ndarray | None = None
) -> np.ndarray:
    R = len(table)
    w_own = table.cost_matrix(lengths)[table.group[replica_of], np.arange(len(lengths))]
    sums = _Sums.of(np.asarray(lengths, dtype=np.int64), w_own, replica_of, R)
    return _estimates(sums, table, np.zeros(R) if bias is None else np.asarray(bias, dtype=np.float64))


def exact_assignment(
    lengths: np.ndarray,
    table: ReplicaTable,
    start: Sequence[Sequence[Sequence[int]]] | None = None,
    time_limit_s: float = 10.0,
    max_slots: int = 8,
) -> tuple[list[list[list[int]]], float, bool] | None:
    """MILP over sequences x replicas x micro-batch slots minimising max_r (sum t + (pp-1) max t).

    `start` (micro-batches per replica, e.g. the heuristic's) warm-starts the solver and
    fixes at least its slot count. Returns (micro-batches per replica, objective, proven
    optimal), or None when no solution was found in time.
    """
    from scipy import sparse  # here, not at import: it costs ~0.1 s and only the exact method needs it

    lengths = np.asarray(lengths, dtype=np.int64)
    n, R = len(lengths), len(table)
    wg = table.cost_matrix(lengths)
    slots = [min(n, max_slots) for _ in range(R)]
    if start is not None:
        slots = [max(slots[r], len(start[r])) for r in range(R)]
    # Column layout: x[i, r, j] for feasible (i, r), then y[r, j], m[r], Z.
    x_cols: list[tuple[int, int, int]] = [
        (i, r, j) for r in range(R) for i in range(n) if table.cap[r] >= lengths[i] for j in range(slots[r])
    ]
    y_off = len(x_cols)
    y_index: dict[tuple[int, int], int] = {}
    for r in range(R):
        for j in range(slots[r]):
            y_index[(r, j)] = y_off + len(y_index)
    m_off = y_off + len(y_index)
    z = m_off + R
    ncol = z + 1
    rows_i, cols_i, vals = [], [], []
    lo, hi = [], []

    def row(entries: list[tuple[int, float]], low: float, high: float) -> None:
        k = len(lo)
        for col, v in entries:
            rows_i.append(k)
            cols_i.append(col)
            vals.append(v)
        lo.append(low)
        hi.append(high)

    by_item: dict[int, list[int]] = {i: [] for i in range(n)}
    by_slot: dict[tuple[int, int], list[int]] = {}
    for col, (i, r, j) in enumerate(x_cols):
        by_item[i].append(col)
        by_slot.setdefault((r, j), []).append(col)
    for i in range(n):
        row([(col, 1.0) for col in by_item[i]], 1.0, 1.0)
    for r in range(R):
        g = int(table.group[r])
        c, pp1 = float(table.c[r]), float(table.pp[r] - 1)
        total: list[tuple[int, float]] = [(z, -1.0), (m_off + r, pp1)]
        for j in range(slots[r]):
            cols = by_slot.get((r, j), [])
            y = y_index[(r, j)]
            row([(col, float(lengths[x_cols[col][0]])) for col in cols] + [(y, -float(table.cap[r]))], -np.inf, 0.0)
            row([(col, float(wg[g, x_cols[col][0]])) for col in cols] + [(y, c), (m_off + r, -1.0)], -np.inf, 0.0)
            total += [(col, float(wg[g, x_cols[col][0]])) for col in cols] + [(y, c)]
            if j + 1 < slots[r]:
                row([(y, 1.0), (y_index[(r, j + 1)], -1.0)], 0.0, np.inf)
        row(total, -np.inf, 0.0)
    a = sparse.csc_matrix((vals, (rows_i, cols_i)), shape=(len(lo), ncol))
    cost = np.zeros(ncol)
    cost[z] = 1.0
    integer = np.zeros(ncol, dtype=bool)
    integer[:m_off] = True
    col_hi = np.full(ncol, np.inf)
    col_hi[:m_off] = 1.0
    x0 = None
    if start is not None:
        x0 = _start_vector(start, lengths, table, x_cols, y_index, m_off, z, ncol)
    res = solve_milp(cost, a, np.array(lo), np.array(hi), np.zeros(ncol), col_hi, integer, time_limit_s, x0)
    if res.x is None:
        return None
    out: list[list[list[int]]] = [[[] for _ in range(slots[r])] for r in range(R)]
    for col in np.flatnonzero(res.x[:y_off] > 0.5).tolist():
        i, r, j = x_cols[col]
        out[r][j].append(i)
    return [[mb for mb in mbs if mb] for mbs in out], res.objective, res.optimal


def _start_vector(start, lengths, table, x_cols, y_index, m_off, z, ncol) -> np.ndarray:
    x0 = np.zeros(ncol)
    where = {key: col for col, key in enumerate(x_cols)}
    wg = table.cost_matrix(lengths)
    worst = 0.0
    for r, mbs in enumerate(start):
        g = int(table.group[r])
        c, pp1 = float(table.c[r]), float(table.pp[r] - 1)
        times = []
        for j, mb in enumerate(sorted(mbs, key=len, reverse=True)):
            x0[y_index[(r, j)]] = 1.0
            for i in mb:
                x0[where[(int(i), r, j)]] = 1.0
            times.append(float(wg[g, list(mb)].sum()) + c)
        if times:
            x0[m_off + r] = max(times)
            worst = max(worst, sum(times) + pp1 * max(times))
    x0[z] = worst
    return x0
