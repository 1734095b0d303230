"""Planning time per iteration of the default planner (targets: <= 50 ms for 32 GPUs / 256K tokens,
<= 1 s for 1024 GPUs / 16M tokens). The pool is built beforehand from other batches (not timed).

    PYTHONPATH=src python benchmarks/planning_time.py [--quick]
"""

from __future__ import annotations

import sys
import time

import numpy as np

from hydraulis.bench import Scenario
from hydraulis.cost import load_cost_model
from hydraulis.planner.planner import Planner
from hydraulis.planner.proposal import propose
from hydraulis.specs import ClusterSpec

K = 1024
CASES = (
    (Scenario("7b-32g-wiki-256k-32k", "llama-7b@a800-80g", 32, 256 * K, 32 * K, "wiki", batches=5), 0.050),
    (Scenario("7b-32g-code-256k-32k", "llama-7b@a800-80g", 32, 256 * K, 32 * K, "code", batches=5), 0.050),
    (Scenario("7b-1024g-wiki-16m-32k", "llama-7b@a800-80g", 1024, 16 * K * K, 32 * K, "wiki", batches=2), 1.0),
)


def main(quick: bool) -> int:
    failed = 0
    for scenario, target in CASES[:2] if quick else CASES:
        cost = load_cost_model(scenario.profile)
        cluster = ClusterSpec(scenario.num_gpus)
        t = time.perf_counter()
        sample = scenario.sample(scenario.seed + 1000, 2)
        pool = propose(cost, cluster, sample, max_length=scenario.max_length).pool.deployments
        built = time.perf_counter() - t
        planner = Planner(cost, scenario.num_gpus, pool)
        times = []
        for step, batch in enumerate(scenario.sample(scenario.seed)):
            plan = planner.plan(batch, step)
            times.append(plan.planning_time_s)
        worst = max(times)
        ok = worst <= target
        failed += not ok
        print(
            f"{scenario.name}: {len(batch)} sequences/batch, pool of {len(pool)} (built in {built:.1f} s); "
            f"planning mean {np.mean(times) * 1e3:.1f} ms, max {worst * 1e3:.1f} ms "
            f"(target {target * 1e3:.0f} ms) {'ok' if ok else 'MISSED'}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main("--quick" in sys.argv))
