"""A thin, time-limited MILP call on HiGHS (highspy), with an optional warm start.

Used by the exact dispatch oracle and by the reference baseline's packing. highspy
and scipy.sparse are imported on first use so that `import hydraulis.planner` stays
fast and the planner works without highspy unless an exact method is asked for.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hydraulis.errors import HydraulisError

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
    lp.num_col_, lp.num_row_ = a.shape[1], a.shape[0]
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
