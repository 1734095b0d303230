"""MILPs on HiGHS (highspy): a thin time-limited call with a warm start, and the exact dispatch.

`exact_assignment` is dispatch's exact method (an option, and the test
oracle): one MILP over sequences x replicas x micro-batch slots with the
closed-form objective sum t + (pp - 1) * max t, warm-started from the
heuristic's plan and time-limited. `solve_milp` also serves the reference
baseline's packing. highspy
and scipy.sparse are imported on first use so that `import hydraulis.planner` stays
fast and the planner works without highspy unless an exact method is asked for.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hydraulis.errors import HydraulisError
from hydraulis.planner.replicas import ReplicaTable

if TYPE_CHECKING:
    from scipy import sparse


@functools.cache
def _swallow_banner() -> None:
    """HiGHS prints a banner on stdout when a process builds its first solver, before options apply."""
    import highspy

    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


@dataclass(frozen=True)
class MilpResult:
    x: np.ndarray | None  # None when no feasible solution was found
    objective: float
    optimal: bool


def solve_milp(
    cost: np.ndarray,
    rows: sparse.spmatrix,
    row_lo: np.ndarray,
    row_hi: np.ndarray,
    col_lo: np.ndarray,
    col_hi: np.ndarray,
    integer: np.ndarray,
    time_limit_s: float,
    start: np.ndarray | None = None,
    rel_gap: float = 1e-4,
) -> MilpResult:
    """min cost.x s.t. row_lo <= rows.x <= row_hi, col bounds, `integer` columns integral."""
    from scipy import sparse  # here, not at import: `import hydraulis.planner` stays fast

    try:
        import highspy
    except ImportError:  # pragma: no cover - highspy is a dependency of the cli extra
        raise HydraulisError("the exact (MILP) methods need highspy: pip install 'hydraulis[cli]'") from None
    a = sparse.csc_matrix(rows)
    lp = highspy.HighsLp()
    lp.num_col_ = a.shape[1]
    lp.num_row_ = a.shape[0]
    lp.col_cost_ = np.asarray(cost, dtype=np.float64)
    lp.col_lower_ = np.asarray(col_lo, dtype=np.float64)
    lp.col_upper_ = np.asarray(col_hi, dtype=np.float64)
    lp.row_lower_ = np.asarray(row_lo, dtype=np.float64)
    lp.row_upper_ = np.asarray(row_hi, dtype=np.float64)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = a.indptr.astype(np.int32)
    lp.a_matrix_.index_ = a.indices.astype(np.int32)
    lp.a_matrix_.value_ = a.data.astype(np.float64)
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in integer]
    _swallow_banner()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(rel_gap))
    h.setOptionValue("threads", 1)
    h.passModel(lp)
    if start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = list(np.asarray(start, dtype=np.float64))
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    info = h.getInfo()
    if info.primal_solution_status != 2:  # kSolutionStatusFeasible
        return MilpResult(None, float("inf"), False)
    x = np.asarray(h.getSolution().col_value)
    return MilpResult(x, float(info.objective_function_value), h.getModelStatus() == highspy.HighsModelStatus.kOptimal)


@dataclass(frozen=True)
class _Columns:
    """The MILP's column layout: x[i, r, j] for feasible (i, r), then y[r, j], m[r], and Z last."""

    x: list[tuple[int, int, int]]  # (sequence, replica, slot) of each x column
    y: dict[tuple[int, int], int]  # (replica, slot) -> column of y: the slot is used
    m_off: int  # m[r], replica r's longest micro-batch time, is column m_off + r
    z: int  # the objective, max over replicas

    @classmethod
    def lay_out(cls, lengths: np.ndarray, table: ReplicaTable, slots: list[int]) -> _Columns:
        replicas = range(len(table))
        fits = [(i, r) for r in replicas for i in range(len(lengths)) if table.cap[r] >= lengths[i]]
        x = [(i, r, j) for i, r in fits for j in range(slots[r])]
        y = {key: len(x) + k for k, key in enumerate((r, j) for r in replicas for j in range(slots[r]))}
        m_off = len(x) + len(y)
        return cls(x, y, m_off, m_off + len(table))

    @property
    def count(self) -> int:
        return self.z + 1


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
    lengths = np.asarray(lengths, dtype=np.int64)
    slots = [min(len(lengths), max_slots) for _ in range(len(table))]
    if start is not None:
        slots = [max(slots[r], len(start[r])) for r in range(len(table))]
    cols = _Columns.lay_out(lengths, table, slots)
    a, lo, hi = _constraints(lengths, table, slots, cols)
    cost = np.zeros(cols.count)
    cost[cols.z] = 1.0
    integer = np.zeros(cols.count, dtype=bool)
    integer[: cols.m_off] = True
    col_hi = np.full(cols.count, np.inf)
    col_hi[: cols.m_off] = 1.0
    x0 = None if start is None else _start_vector(start, lengths, table, cols)
    res = solve_milp(cost=cost, rows=a, row_lo=lo, row_hi=hi, col_lo=np.zeros(cols.count), col_hi=col_hi,
                     integer=integer, time_limit_s=time_limit_s, start=x0)
    if res.x is None:
        return None
    out: list[list[list[int]]] = [[[] for _ in range(slots[r])] for r in range(len(table))]
    for col in np.flatnonzero(res.x[: len(cols.x)] > 0.5).tolist():
        i, r, j = cols.x[col]
        out[r][j].append(i)
    return [[mb for mb in mbs if mb] for mbs in out], res.objective, res.optimal


def _constraints(
    lengths: np.ndarray, table: ReplicaTable, slots: list[int], cols: _Columns
) -> tuple[sparse.spmatrix, np.ndarray, np.ndarray]:
    """The rows lo <= A x <= hi: each sequence placed once; per slot, tokens within the cap and
    time below m[r]; slots used in order; per replica, sum t + (pp - 1) m[r] <= Z."""
    from scipy import sparse  # here, not at import: it costs ~0.1 s and only the exact method needs it

    wg = table.cost_matrix(lengths)
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

    by_item: dict[int, list[int]] = {i: [] for i in range(len(lengths))}
    by_slot: dict[tuple[int, int], list[int]] = {}
    for col, (i, r, j) in enumerate(cols.x):
        by_item[i].append(col)
        by_slot.setdefault((r, j), []).append(col)
    for i in range(len(lengths)):
        row([(col, 1.0) for col in by_item[i]], 1.0, 1.0)
    for r in range(len(table)):
        g = int(table.group[r])
        c, pp1, m = float(table.c[r]), float(table.pp[r] - 1), cols.m_off + r
        total: list[tuple[int, float]] = [(cols.z, -1.0), (m, pp1)]
        for j in range(slots[r]):
            in_slot = by_slot.get((r, j), [])
            y = cols.y[(r, j)]
            row([(col, float(lengths[cols.x[col][0]])) for col in in_slot] + [(y, -float(table.cap[r]))], -np.inf, 0.0)
            times = [(col, float(wg[g, cols.x[col][0]])) for col in in_slot] + [(y, c)]
            row(times + [(m, -1.0)], -np.inf, 0.0)
            total += times
            if j + 1 < slots[r]:
                row([(y, 1.0), (cols.y[(r, j + 1)], -1.0)], 0.0, np.inf)
        row(total, -np.inf, 0.0)
    a = sparse.csc_matrix((vals, (rows_i, cols_i)), shape=(len(lo), cols.count))
    return a, np.array(lo), np.array(hi)


def _start_vector(
    start: Sequence[Sequence[Sequence[int]]], lengths: np.ndarray, table: ReplicaTable, cols: _Columns
) -> np.ndarray:
    """The warm start as a column vector: the heuristic's micro-batches, longest first per replica."""
    x0 = np.zeros(cols.count)
    where = {key: col for col, key in enumerate(cols.x)}
    wg = table.cost_matrix(lengths)
    worst = 0.0
    for r, mbs in enumerate(start):
        g = int(table.group[r])
        c, pp1 = float(table.c[r]), float(table.pp[r] - 1)
        times = []
        for j, mb in enumerate(sorted(mbs, key=len, reverse=True)):
            x0[cols.y[(r, j)]] = 1.0
            for i in mb:
                x0[where[(int(i), r, j)]] = 1.0
            times.append(float(wg[g, list(mb)].sum()) + c)
        if times:
            x0[cols.m_off + r] = max(times)
            worst = max(worst, sum(times) + pp1 * max(times))
    x0[cols.z] = worst
    return x0
