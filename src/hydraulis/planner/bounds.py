"""The balance-efficiency lower bound (docs/design.md section 5).

    LB = max( sum_i min_g n_g * (a_g s_i^2 + b_g s_i) / N ,  max_i min_g pp_g * (a_g s_i^2 + b_g s_i) )

over the configs g (n_g = tp*pp*cp GPUs, at most N) whose cap holds s_i; c and
bubbles are left out, so no plan can beat it.
"""

from __future__ import annotations

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.errors import HydraulisError


def lower_bound(lengths: np.ndarray, cost: CostModel, num_gpus: int) -> float:
    lengths = np.asarray(lengths, dtype=np.int64)
    caps = cost.caps(num_gpus)
    configs = list(caps)
    if not configs:
        smallest = min(g.num_gpus for g in cost.configs)
        raise HydraulisError(f"no parallel config of {cost.name} fits {num_gpus} GPU(s); the smallest needs {smallest}")
    cap = np.array([caps[g] for g in configs])[:, None]
    w = cost.cost_matrix(lengths, configs)
    gpus = np.array([g.num_gpus for g in configs], dtype=np.float64)[:, None]
    pp = np.array([g.pp for g in configs], dtype=np.float64)[:, None]
    fits = cap >= lengths[None, :]
    if not fits.any(axis=0).all():
        longest = int(lengths[~fits.any(axis=0)].max())
        raise HydraulisError(f"no config holds a sequence of {longest} tokens (largest cap {int(cap.max())})")
    spread = np.where(fits, gpus * w, np.inf).min(axis=0).sum() / num_gpus
    trip = np.where(fits, pp * w, np.inf).min(axis=0).max()
    return float(max(spread, trip))
