"""Fitting (a, b, c) from measured micro-batch times by least squares."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import nnls

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
    X = np.array([[sum(s * s for s in mb), sum(mb), 1.0] for mb in micro_batches], dtype=np.float64)
    scale = X.max(axis=0)
    scale[scale == 0] = 1.0
    w = 1.0 / t
    coef, _ = nnls((X / scale) * w[:, None], t * w)
    coef = coef / scale
    return Coefficients(float(coef[0]), float(coef[1]), float(coef[2]))
