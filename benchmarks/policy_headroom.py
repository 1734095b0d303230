"""What memory policies per micro-batch can gain on peers.py's data, by memory budget (issue 42), predicted.

Its oracle is the plan with no budget at all: recompute only adds time, so no memory lever can beat planning
as if memory never bound. Per budget, on peers.py's batches and pool (the `bounded` and `tight` setting's
data, 12 batches, tiny@cpu-measured, fp32) the planner's predicted seconds:

- `off`: policies off (a config's own cap decides, as `hydraulis policies off` in peers.py);
- `on`: a memory policy per micro-batch (`CostModel.with_policies`), as `hydraulis` in peers.py;
- `unbounded`: no budget (the oracle);

(inf where some batch fits no deployment), and `gain` = off / on (what peers.py measures against its
prediction), `headroom` = off / unbounded (the most any memory lever could gain there).
Simulated: load does not move the figures.

    PYTHONPATH=src python benchmarks/policy_headroom.py [BUDGET ...]   (default 24MiB ... 40MiB)
"""

from __future__ import annotations

import sys

import numpy as np
from peers import SEED, SETTINGS, WORLD

from hydraulis.cost import load_cost_model
from hydraulis.data.builtin import ensure_builtin
from hydraulis.data.sampler import TokenBudgetSampler
from hydraulis.errors import HydraulisError
from hydraulis.limits import parse_size
from hydraulis.planner.planner import Planner
from hydraulis.planner.pool import parse_pool
from hydraulis.specs import ClusterSpec

BUDGETS = ("24MiB", "26MiB", "28MiB", "30MiB", "32MiB", "34MiB", "36MiB", "40MiB")


def predicted(cost, pool, batches: list[np.ndarray]) -> float:
    """The planner's predicted seconds over the batches (inf where some batch fits no deployment)."""
    planner = Planner(cost, WORLD, pool)
    try:
        return sum(planner.plan(b, i).predicted_time_s for i, b in enumerate(batches))
    except HydraulisError:
        return float("inf")


def main(budgets: list[str]) -> int:
    s = SETTINGS["bounded"]
    corpus = ensure_builtin(s.corpus, s.tokenizer)
    sampler = TokenBudgetSampler(corpus.lengths, s.tokens, s.max_len, seed=SEED, policy=s.overlong)
    batches = [b.lengths for b in sampler.batches(12)]
    pool = parse_pool(s.pool, ClusterSpec(WORLD, WORLD))
    base = load_cost_model(s.profile)
    unbounded = predicted(base.for_job(None, 4), pool, batches)
    print(f"peers.py's data, pool {s.pool}; no budget (the oracle): {unbounded:.3f} s")
    print(f"{'budget':>8} {'off s':>8} {'on s':>8} {'gain':>7} {'headroom':>9}")
    for budget in budgets:
        cost = base.for_job(parse_size(budget, "budget"), 4)
        off, on = predicted(cost, pool, batches), predicted(cost.with_policies(True), pool, batches)
        ratios = [f"{off / t:.3f}x" if np.isfinite(off) else "no fit" for t in (on, unbounded)]
        print(f"{budget:>8} {off:8.3f} {on:8.3f} {ratios[0]:>7} {ratios[1]:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(BUDGETS)))
