"""Fitting (a, b, c) from measured micro-batch times by least squares, and how well a fit predicts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.model import Coefficients
from hydraulis.errors import HydraulisError


def fit_coefficients(micro_batches: Sequence[Sequence[int]], times_s: Sequence[float]) -> Coefficients:
    """Non-negative least squares of t = a*sum(s^2) + b*sum(s) + c.

    Relative residuals are minimised (rows scaled by 1/t), so that short
    micro-batches count as much as long ones.
    """
    if len(micro_batches) != len(times_s):
        raise HydraulisError(f"{len(micro_batches)} micro-batches but {len(times_s)} times")
    if len(micro_batches) < 3:
        raise HydraulisError("fitting a, b, c needs at least 3 measurements")
    t = np.asarray(times_s, dtype=np.float64)
    if np.any(t <= 0):
        raise HydraulisError("measured times must be positive")
    from scipy.optimize import nnls  # here, not at import: 0.4 s that every rank would pay, and only fits need it

    X = np.array([[sum(s * s for s in mb), sum(mb), 1.0] for mb in micro_batches], dtype=np.float64)
    scale = X.max(axis=0)
    scale[scale == 0] = 1.0
    w = 1.0 / t
    coef, _ = nnls((X / scale) * w[:, None], t * w)
    coef = coef / scale
    return Coefficients(float(coef[0]), float(coef[1]), float(coef[2]))


# -- robust fits for `hydraulis profile` -------------------------------------------------------------


@dataclass(frozen=True)
class FitResult:
    """Fitted coefficients and the relative residual (predicted - measured) / measured of every point."""

    coefficients: Coefficients
    residuals: tuple[float, ...]


def _design(micro_batches: Sequence[Sequence[int]]) -> np.ndarray:
    return np.array(
        [[float(sum(int(s) * int(s) for s in mb)), float(sum(int(s) for s in mb)), 1.0] for mb in micro_batches],
        dtype=np.float64,
    )


def _robust_nonnegative(X: np.ndarray, t: np.ndarray, f_scale: float) -> np.ndarray:
    """min sum rho((X @ coef - t) / t) over coef >= 0, rho soft-l1: a few disturbed timings barely pull the fit.

    Columns are scaled to [0, 1] for conditioning; NNLS on the same relative residuals starts it.
    """
    from scipy.optimize import least_squares, nnls  # as in fit_coefficients

    scale = X.max(axis=0)
    scale[scale == 0] = 1.0
    Xs = X / scale
    w = 1.0 / t
    start, _ = nnls(Xs * w[:, None], t * w)
    # trf needs a start strictly inside the bounds.
    x0 = np.maximum(start, 1e-12 * max(float(t.max()), 1e-30))
    result = least_squares(
        lambda x: (Xs @ x - t) * w, x0, bounds=(0.0, np.inf), loss="soft_l1", f_scale=f_scale, method="trf"
    )
    return np.maximum(result.x, 0.0) / scale


def fit_robust(micro_batches: Sequence[Sequence[int]], times_s: Sequence[float], f_scale: float = 0.05) -> FitResult:
    """t = a*sum(s^2) + b*sum(s) + c by robust least squares on relative residuals, a, b, c >= 0.

    Why robust: profiling shares the machine with whatever else runs, and one
    disturbed point should not move a coefficient; why relative: short
    micro-batches matter to the planner as much as long ones. `f_scale` is
    the relative error beyond which a residual counts as an outlier (soft-l1).
    """
    if len(micro_batches) != len(times_s):
        raise HydraulisError(f"{len(micro_batches)} micro-batches but {len(times_s)} times")
    if len(micro_batches) < 3:
        raise HydraulisError("fitting a, b, c needs at least 3 measurements")
    t = np.asarray(times_s, dtype=np.float64)
    if np.any(~np.isfinite(t)) or np.any(t <= 0):
        raise HydraulisError("measured times must be positive")
    X = _design(micro_batches)
    coef = _robust_nonnegative(X, t, f_scale)
    residuals = (X @ coef - t) / t
    return FitResult(Coefficients(float(coef[0]), float(coef[1]), float(coef[2])), tuple(float(r) for r in residuals))


def fidelity(predicted: Sequence[float], measured: Sequence[float]) -> dict[str, float | int]:
    """Median and worst absolute relative error |predicted - measured| / measured (the train report's figures)."""
    p = np.asarray(predicted, dtype=np.float64)
    m = np.asarray(measured, dtype=np.float64)
    if p.shape != m.shape:
        raise HydraulisError(f"{p.size} predictions but {m.size} measurements")
    if m.size == 0:
        raise HydraulisError("fidelity needs at least one measurement")
    if np.any(m <= 0):
        raise HydraulisError("measured values must be positive")
    err = np.abs(p - m) / m
    return {"median_abs_rel_error": float(np.median(err)), "worst_abs_rel_error": float(err.max()), "n": int(m.size)}


def holdout_split(n: int, fraction: float = 1 / 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Indices (fit, held out): a seeded `fraction` of n points held out, at least one, leaving at least 3 to fit."""
    if n < 4:
        raise HydraulisError(f"a held-out check needs at least 4 points, got {n}")
    held = min(max(1, round(n * fraction)), n - 3)
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[held:]), np.sort(order[:held])


def holdout_fidelity(
    micro_batches: Sequence[Sequence[int]], times_s: Sequence[float], fraction: float = 1 / 3, seed: int = 0
) -> dict[str, float | int]:
    """Fit on the rest, predict the held-out points: how well the fitted model predicts unseen micro-batches."""
    fit_idx, held_idx = holdout_split(len(micro_batches), fraction, seed)
    fitted = fit_robust([micro_batches[i] for i in fit_idx], [times_s[i] for i in fit_idx]).coefficients
    X = _design([micro_batches[i] for i in held_idx])
    predicted = X @ np.array([fitted.a, fitted.b, fitted.c])
    return fidelity(predicted, [times_s[i] for i in held_idx])


def fit_link(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of t = latency + bytes / bandwidth, robust and non-negative."""
    if len(sizes_bytes) != len(times_s) or len(sizes_bytes) < 2:
        raise HydraulisError("fitting a link needs at least 2 (size, time) pairs")
    t = np.asarray(times_s, dtype=np.float64)
    if np.any(t <= 0):
        raise HydraulisError("measured times must be positive")
    X = np.stack([np.ones_like(t), np.asarray(sizes_bytes, dtype=np.float64)], axis=1)
    latency, per_byte = _robust_nonnegative(X, t, 0.1)
    # A link too fast to resolve at these sizes still needs a finite bandwidth.
    per_byte = max(per_byte, 1e-15)
    return float(latency), float(1.0 / per_byte)
