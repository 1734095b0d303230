"""Stage 1: dispatch every sequence of a global batch to a replica.

Objective: the slowest replica's 1F1B time, estimated from its sequences as in
`replicas.estimate_time` (so dispatch already pays for c per micro-batch and the
(pp - 1) x largest bubble that packing will produce).

Heuristic (default): longest first, each sequence to the replica that would
finish earliest with it among those whose cap holds it (identical replicas share
a heap, so a step costs one estimate per distinct config); then local search off
the bottleneck replica, moves and swaps (local_search.py). On a deployment of
one config the search also starts from Karmarkar-Karp's partition of the
sequences' costs (flops-balanced's), and the better estimate wins: each start is
ahead on some batches. A replica that would only slow the iteration down stays
empty.

Exact (option, and the test oracle): milp.exact_assignment, one MILP over
sequences x replicas x micro-batch slots.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hydraulis.errors import HydraulisError
from hydraulis.planner.local_search import local_search
from hydraulis.planner.replicas import (
    BULK_MIN_SEQUENCES,
    HEAVY_SHARE,
    ReplicaSums,
    ReplicaTable,
    estimate_time,
    estimates,
)


class NoRoom(HydraulisError):
    """No replica of the deployment has room for a sequence: every one that holds it by its cap already
    runs a sequence beyond its cap as its lone micro-batch (replicas.py). The deployment cannot take
    this batch; the planner tries others."""


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


# A replica's arguments of `_scalar_estimate` after the four sums: c, pp - 1 (the bubble's stages), cap, min_efficient,
# lone cap, long_w (None, None: no lone micro-batch) and wrap.
EstimateParams = tuple[float, float, int, int, int | None, float | None, int]


def _scalar_estimate(W: float, T: int, n: int, wmax: float, params: EstimateParams) -> float:
    """`estimate_time` for one replica in plain Python: the greedy's inner loop (its parameters one tuple: a call
    of eleven keywords took longer than the estimate)."""
    if n == 0:
        return 0.0
    c, pp1, cap, me, lone, long_w, wrap = params
    if lone is not None and long_w is not None and wmax > long_w:  # a lone micro-batch (replicas.py)
        return max(pp1 + 1, wrap) * (W + c) if lone >= T else math.inf
    vmin = max(1, -(-T // cap))
    if pp1 == 0:
        return W + vmin * c
    busy = T // me if me > 1 else T
    vmax = vmin if busy < vmin or n < vmin else (n if n < busy else busy)
    v = math.floor(math.sqrt(pp1 * W / (c if c > 1e-12 else 1e-12)))  # c = 0: as many micro-batches as allowed
    # min(max(v, vmin), vmax) and the same for v + 1, spelled out: this is the greedy's inner loop
    u = vmin if v < vmin else (vmax if v > vmax else v)
    q = W / u
    best = W + u * c + pp1 * ((q if q >= wmax else wmax) + c)
    if u < wrap:  # an interleaved replica's chunks come round (replicas.py)
        best += (q + c) * (wrap - u) * (1 - pp1 / (wrap - 1))
    u = vmin if v + 1 < vmin else (vmax if v + 1 > vmax else v + 1)
    q = W / u
    other = W + u * c + pp1 * ((q if q >= wmax else wmax) + c)
    if u < wrap:
        other += (q + c) * (wrap - u) * (1 - pp1 / (wrap - 1))
    return other if other < best else best


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
    heaps = _config_heaps(table, bias_l)
    params: list[EstimateParams] = [(m.c, m.bubble_stages, m.estimate_cap, m.min_efficient, m.holds, m.long_w, m.wrap)
                                    for m in table.configs]
    W = [0.0] * R
    T = [0] * R
    n = [0] * R
    wmax = [0.0] * R
    out = [0] * len(L)

    def estimate(g: int, r: int, s: int, wi: float) -> float:
        p = params[g]
        if p[1] == 0 and max(wmax[r], wi) <= p[5]:  # the common case, inlined: W + c * ceil(T / cap)
            return W[r] + wi + p[0] * max(1, -(-(T[r] + s) // p[2])) + bias_l[r]
        return _scalar_estimate(W[r] + wi, T[r] + s, n[r] + 1, max(wmax[r], wi), p) + bias_l[r]

    for i, p in zip(order, positions, strict=True):
        s = L[i]
        best, best_g, best_r = math.inf, -1, -1
        for g in groups:
            if params[g][4] < s:
                continue
            wi = w[g][p]
            r = heaps[g][0][1]
            e = estimate(g, r, s, wi)
            if e == math.inf:  # the least loaded holds a sequence beyond the cap and has no room: try the others
                e, r = _scan(heap=heaps[g], estimate=estimate, g=g, s=s, wi=wi, lone_params=params[g][4:6], wmax=wmax,
                             T=T)
            if e < best:
                best, best_g, best_r = e, g, r
        if best_g < 0:
            raise NoRoom(f"no replica has room for a sequence of {s} tokens")  # callers check caps first
        wi = w[best_g][p]
        W[best_r] += wi
        T[best_r] += s
        n[best_r] += 1
        if wi > wmax[best_r]:
            wmax[best_r] = wi
        _rekey(heaps[best_g], best_r, best)
        out[i] = best_r
    replica_of = np.array(out, dtype=np.int64)
    if head < len(lengths):
        sums = ReplicaSums(np.array(W), np.array(T, dtype=np.int64), np.array(n, dtype=np.int64), np.array(wmax))
        _water_fill(lengths=lengths, w=w_arr, tail=order_a[head:], table=table, bias=bias_a, sums=sums,
                    replica_of=replica_of)
    return replica_of


def _scan(
    heap: list[tuple[float, int]], estimate: Callable[[int, int, int, float], float], g: int, s: int, wi: float,
    lone_params: tuple[int, float], wmax: list[float], T: list[int],
) -> tuple[float, int]:
    """The least (estimate, replica) of config g's replicas for a sequence of `s` tokens (cost `wi`), without
    estimating those with no room: a replica holding, or about to hold, a sequence beyond the cap runs one lone
    micro-batch of at most `lone` tokens (`_scalar_estimate`'s inf). Long-context batches leave such a full
    replica at its heap's top for every shorter sequence."""
    lone, long_w = lone_params
    lone_s = wi > long_w
    return min(((math.inf if (lone_s or wmax[q] > long_w) and T[q] + s > lone else estimate(g, q, s, wi), q)
                for _, q in heap), default=(math.inf, -1))


def _config_heaps(table: ReplicaTable, keys: list[float]) -> list[list[tuple[float, int]]]:
    """Per distinct config, a heap of its replicas by key (the estimate so far, at first the bias)."""
    heaps: list[list[tuple[float, int]]] = [[] for _ in table.configs]
    for r in range(len(table)):
        heaps[int(table.group[r])].append((keys[r], r))
    for h in heaps:
        heapq.heapify(h)
    return heaps


def _rekey(heap: list[tuple[float, int]], replica: int, key: float) -> None:
    """Give `replica` its new key: the top's in place, another's (it took a sequence its config's least
    loaded had no room for, a lone micro-batch) by removal and push."""
    if heap[0][1] == replica:
        heapq.heapreplace(heap, (key, replica))
        return
    heap.pop([q for _, q in heap].index(replica))
    heapq.heapify(heap)
    heapq.heappush(heap, (key, replica))


def _water_fill(
    lengths: np.ndarray,
    w: np.ndarray,
    tail: np.ndarray,
    table: ReplicaTable,
    bias: np.ndarray,
    sums: ReplicaSums,
    replica_of: np.ndarray,
) -> None:
    """Light sequences (longest first, in runs) to replicas, each run raising the least loaded to one level.

    Within a run every replica's estimate is taken as linear in the count it
    receives (slope from a probe of the run's fair share), the common level is
    solved exactly, and counts are rounded so that the run is placed whole.
    Caps hold: a run only goes to replicas whose cap holds its longest sequence.
    """
    group = table.group
    p = table.params
    for run in np.array_split(tail, min(BULK_RUNS, len(tail))):
        m = len(run)
        if m == 0:
            continue
        s_run = lengths[run]
        w_run = w[:, run]  # [configs, m]
        # Not onto a replica holding a sequence beyond its cap: it runs a lone micro-batch (replicas.py).
        ok = np.flatnonzero((table.lone_cap >= int(s_run[0])) & (sums.wmax <= table.long_w))
        if len(ok) == 0:
            raise NoRoom(f"no replica has room for a sequence of {int(s_run[0])} tokens")  # callers check caps first
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
    with np.errstate(divide="ignore"):  # a replica the run's next sequence would push past its lone cap (slope
        level = (m + np.cumsum(e * inv)) / np.cumsum(inv)  # inf) absorbs nothing: alone, its level is inf
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


def dispatch(lengths: np.ndarray, table: ReplicaTable, bias: np.ndarray | None = None, search: bool = True) -> Dispatch:
    """The default heuristic: greedy earliest-finish, then (if `search`) local search (`improve`)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    R = len(table)
    bias = np.zeros(R) if bias is None else np.asarray(bias, dtype=np.float64)
    replica_of = greedy_dispatch(lengths, table, bias)
    if search:
        return improve(lengths, table, Dispatch(replica_of, np.zeros(R)), bias)
    return Dispatch(replica_of, estimated_times(lengths, table, replica_of, bias))


def improve(lengths: np.ndarray, table: ReplicaTable, d: Dispatch, bias: np.ndarray | None = None) -> Dispatch:
    """Local search on an existing dispatch; on a deployment of one config also from Karmarkar-Karp's partition
    of the sequences' costs, keeping the better estimate (the greedy and KK each win on some batches)."""
    found = []
    for start in (d.replica_of, balanced_start(lengths, table)):
        if start is not None:
            replica_of = local_search(lengths, table, start, bias)
            found.append(Dispatch(replica_of, estimated_times(lengths, table, replica_of, bias)))
    return min(found, key=lambda x: x.makespan_s)


# The last partition `balanced_start` made: a candidate's packing and its refinement rounds start the local
# search from it again on the same table and batch (the bias changes, the partition does not).
_last_partition: tuple[ReplicaTable, tuple[str, bytes], np.ndarray] | None = None


def balanced_start(lengths: np.ndarray, table: ReplicaTable) -> np.ndarray | None:
    """Karmarkar-Karp on a*s^2 + b*s over the replicas of a one-config deployment (flops-balanced's partition),
    or None: several configs cost a sequence differently, a bulk batch is water-filled instead, and a sequence
    beyond the cap runs alone (its replica's lone micro-batch), which the partition does not know."""
    if len(table.configs) != 1 or len(table) == 1 or len(lengths) >= BULK_MIN_SEQUENCES:
        return None
    if int(np.max(lengths, initial=0)) > table.configs[0].cap:
        return None
    global _last_partition  # noqa: PLW0603 - a one-entry memo
    key = (lengths.dtype.str, lengths.tobytes())
    last = _last_partition
    if last is not None and last[0] is table and last[1] == key:
        return last[2].copy()
    replica_of = np.empty(len(lengths), dtype=np.int64)
    for r, part in enumerate(karmarkar_karp(table.cost_matrix(lengths)[0], len(table))):
        replica_of[part] = r
    _last_partition = (table, key, replica_of.copy())
    return replica_of


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


def estimated_times(
    lengths: np.ndarray, table: ReplicaTable, replica_of: np.ndarray, bias: np.ndarray | None = None
) -> np.ndarray:
    R = len(table)
    w_own = table.cost_matrix(lengths)[table.group[replica_of], np.arange(len(lengths))]
    sums = ReplicaSums.of(np.asarray(lengths, dtype=np.int64), w_own, replica_of, R)
    return estimates(sums, table, np.zeros(R) if bias is None else np.asarray(bias, dtype=np.float64))
