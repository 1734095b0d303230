"""How fast the event-level simulator runs a large plan.

A 64-GPU heterogeneous deployment, 1,000 micro-batches in all. Target: under 100 ms.
Run: .venv/bin/python benchmarks/sim_speed.py
"""

from __future__ import annotations

import time

import numpy as np

from hydraulis.cost import load_cost_model
from hydraulis.parallel import Deployment
from hydraulis.planner.plan import plan_from_assignment
from hydraulis.planner.sim import simulate
from hydraulis.specs import ClusterSpec


def main() -> None:
    cost = load_cost_model("llama-7b@a800-80g")
    cluster = ClusterSpec(64)
    deployment = Deployment.parse("2x(tp8,pp1) + 2x(tp4,pp2) + 4x(tp2,pp2) + 4x(tp1,pp2) + 1x(tp1,pp8)", cluster)
    rng = np.random.default_rng(0)
    per_replica = 1000 // len(deployment)
    counts = [per_replica] * len(deployment)
    counts[0] += 1000 - sum(counts)
    lengths, micro_batches = [], []
    for replica, v in zip(deployment.replicas, counts, strict=True):
        cap = cost.cap(replica.config, 64)
        mbs = []
        for _ in range(v):
            n = int(rng.integers(1, 5))
            mb_lengths = rng.integers(64, max(65, cap // n), size=n)
            mbs.append(list(range(len(lengths), len(lengths) + n)))
            lengths += mb_lengths.tolist()
        micro_batches.append(mbs)
    plan = plan_from_assignment(0, lengths, deployment, micro_batches, 0.0)
    simulate(plan, cost)  # warm up imports and caches
    runs = []
    for keep_events in (False, True):
        t0 = time.perf_counter()
        result = simulate(plan, cost, keep_events=keep_events)
        runs.append((keep_events, time.perf_counter() - t0))
    mbs = sum(len(r.micro_batches) for r in plan.replicas)
    print(f"deployment {deployment}: {mbs} micro-batches, {len(lengths)} sequences")
    print(f"simulated iteration time {result.iteration_time_s:.2f} s, bubble {result.bubble_fraction:.1%}")
    for keep_events, seconds in runs:
        label = "with timeline" if keep_events else "times only   "
        print(f"simulate {label}: {seconds * 1e3:7.1f} ms  (target < 100 ms: {'ok' if seconds < 0.1 else 'MISSED'})")


if __name__ == "__main__":
    main()
