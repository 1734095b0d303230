"""hydraulis-reference: the published Hydraulis system (docs/design.md, section 5) on its own pool.

The pool is the published range DP's (PolicyContext.reference_pool), or the
user's pool when one is given; then:

1. Dispatch, for each pool deployment that holds the batch: randomised greedy
   over 50 shuffles of the batch, each sequence to the cap-feasible replica
   whose objective sum + (pp - 1) * max of sequence costs is least once the
   sequence is added (min-max greedy, as published; not the replica whose
   objective grows least); keep the shuffle with the least max over
   replicas. The deployment with the least such objective runs the batch.
2. Packing, per replica and micro-batch count v (from the token-cap minimum,
   up to 16 counts): a MILP balancing micro-batch cost under the token cap,
   0.5 s limit (HiGHS for the published CBC); keep the v minimising
   (max + c) * (v + pp - 1). Counts whose bound max(W/v, w_max) cannot beat
   the best found are skipped without a solve (same answer, less time).
"""

from __future__ import annotations

import time

import numpy as np

from hydraulis.errors import OverlongError
from hydraulis.limits import check_lengths
from hydraulis.planner.milp import solve_milp
from hydraulis.planner.packing import first_fit_decreasing
from hydraulis.planner.planner import finalize
from hydraulis.planner.policy import PolicyContext
from hydraulis.planner.pool import largest_cap
from hydraulis.planner.replicas import ReplicaCost, ReplicaTable
from hydraulis.planner.schedule import Schedule

SHUFFLES = 50
MILP_LIMIT_S = 0.5
MAX_COUNTS = 16


def randomized_greedy(
    lengths: np.ndarray, table: ReplicaTable, rng: np.random.Generator, shuffles: int = SHUFFLES
) -> tuple[np.ndarray, float]:
    """Best of `shuffles` greedy passes: (replica per sequence, max over replicas of sum + (pp-1) max).

    Each pass puts each sequence on the replica whose sum + (pp-1) max is least after adding it."""
    w = table.cost_matrix(lengths)[table.group]  # [R, n]
    pp1 = table.pp - 1
    fits = table.cap[:, None] >= lengths[None, :]
    best, best_obj = None, np.inf
    for _ in range(shuffles):
        total = np.zeros(len(table))
        top = np.zeros(len(table))
        out = np.empty(len(lengths), dtype=np.int64)
        for i in rng.permutation(len(lengths)).tolist():
            new = total + w[:, i] + pp1 * np.maximum(top, w[:, i])
            new[~fits[:, i]] = np.inf
            r = int(np.argmin(new))
            total[r] += w[r, i]
            top[r] = max(top[r], w[r, i])
            out[i] = r
        obj = float((total + pp1 * top).max())
        if obj < best_obj:
            best, best_obj = out, obj
    assert best is not None
    return best, best_obj


def milp_bins(s: np.ndarray, w: np.ndarray, cap: int, v: int, time_limit_s: float) -> list[list[int]] | None:
    """min max-bin cost over v bins under the token cap; positions per non-empty bin, or None."""
    from scipy import sparse  # imported on first use, as in milp.py

    n = len(s)
    nx = n * v
    ncol = nx + 1  # x[i, j] at i * v + j, then M
    rows, cols, vals = [], [], []
    r = 0
    for i in range(n):  # each sequence in one bin
        rows += [r] * v
        cols += list(range(i * v, i * v + v))
        vals += [1.0] * v
        r += 1
    for j in range(v):  # tokens, then cost - M
        rows += [r] * n
        cols += list(range(j, nx, v))
        vals += s.astype(float).tolist()
        r += 1
        rows += [r] * (n + 1)
        cols += list(range(j, nx, v)) + [nx]
        vals += w.tolist() + [-1.0]
        r += 1
    a = sparse.csc_matrix((vals, (rows, cols)), shape=(r, ncol))
    lo = np.concatenate([np.ones(n), np.tile([-np.inf, -np.inf], v)])
    hi = np.concatenate([np.ones(n), np.tile([float(cap), 0.0], v)])
    cost = np.zeros(ncol)
    cost[nx] = 1.0
    integer = np.ones(ncol, dtype=bool)
    integer[nx] = False
    col_hi = np.ones(ncol)
    col_hi[nx] = np.inf
    res = solve_milp(
        cost, a, row_lo=lo, row_hi=hi, col_lo=np.zeros(ncol), col_hi=col_hi, integer=integer, time_limit_s=time_limit_s
    )
    if res.x is None:
        return None
    x = res.x[:nx].reshape(n, v) > 0.5
    bins = [np.flatnonzero(x[:, j]).tolist() for j in range(v)]
    return [b for b in bins if b]


def pack_reference(s: np.ndarray, replica: ReplicaCost, time_limit_s: float = MILP_LIMIT_S) -> list[list[int]]:
    """Positions per micro-batch: the v (and MILP packing) with the least (max + c) * (v + pp - 1)."""
    w = replica.seq_costs(s)
    W, wmax, pp1 = float(w.sum()), float(w.max()), replica.pp - 1
    vmin = max(1, -(-int(s.sum()) // replica.cap))
    best, best_obj = None, np.inf
    for v in range(vmin, min(vmin + MAX_COUNTS - 1, len(s)) + 1):  # at most MAX_COUNTS counts
        if (max(W / v, wmax) + replica.c) * (v + pp1) >= best_obj:
            continue
        bins = [list(range(len(s)))] if v == 1 else milp_bins(s, w, replica.cap, v, time_limit_s)
        if bins is None:
            continue
        obj = (max(float(w[b].sum()) for b in bins) + replica.c) * (v + pp1)
        if obj < best_obj:
            best, best_obj = bins, obj
    return best if best is not None else first_fit_decreasing(s, replica.cap)


class Reference:
    name = "hydraulis-reference"

    def __init__(self, ctx: PolicyContext, seed: int = 0) -> None:
        self.ctx = ctx
        self.cost = ctx.cost
        self.tables = [ReplicaTable.of(ctx.cost, d, ctx.num_gpus) for d in ctx.reference_pool]
        self.seed = seed

    def schedule(self, lengths: np.ndarray, step: int = 0) -> Schedule:
        start = time.perf_counter()
        lengths = check_lengths(lengths)
        rng = np.random.default_rng(self.seed + step)
        best = None
        for k, table in enumerate(self.tables):
            if int(table.cap.max()) < int(lengths.max()):
                continue
            replica_of, obj = randomized_greedy(lengths, table, rng)
            if best is None or obj < best[0]:
                best = (obj, k, replica_of)
        if best is None:
            cap, name = largest_cap(self.ctx.cost, self.ctx.cluster, self.ctx.reference_pool, lone=False)
            raise OverlongError(int(lengths.max()), cap, name, where=self.name, scope="in its pool",
                                policies=("truncate", "drop"), remedies=("a pool with larger replicas",))
        _, k, replica_of = best
        table = self.tables[k]
        micro_batches = []
        for r in range(len(table)):
            idx = np.flatnonzero(replica_of == r)
            if len(idx) == 0:
                micro_batches.append([])
                continue
            bins = pack_reference(lengths[idx], table.replicas[r])
            micro_batches.append([idx[b].tolist() for b in bins])
        plan = finalize(
            step, lengths, self.ctx.reference_pool[k], micro_batches=micro_batches, cost=self.ctx.cost, started=start
        )
        return Schedule.single(plan)
