"""How fast the event-level simulator runs a large plan.

A 64-GPU heterogeneous deployment, 1,000 micro-batches in all. Target: under 100 ms.
Then the deep interleaved replicas of long-70b-256g's pool (one layer per chunk): building a shape's event order
(`sim._sweep`, once per (pp, micro-batches, vp): a first plan builds about 200) and one simulation of it.
Run: .venv/bin/python benchmarks/sim_speed.py
"""

from __future__ import annotations

import time

import numpy as np

from hydraulis.cost import load_cost_model
from hydraulis.parallel import Deployment
from hydraulis.planner.plan import plan_from_assignment
from hydraulis.planner.sim import _sweep, simulate, simulate_replica
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


DEEP = ((16, 5, 32), (8, 10, 40), (8, 10, 12))  # (pp, vp, micro-batches)


def deep() -> None:
    from hydraulis.pipeline_order import event_arrays

    rng = np.random.default_rng(0)
    for pp, vp, m in DEEP:
        built = []
        for _ in range(5):
            event_arrays.cache_clear()
            _sweep.cache_clear()
            t0 = time.perf_counter()
            _sweep(pp, m, vp)
            built.append(time.perf_counter() - t0)
        times = rng.uniform(1.0, 3.0, m)
        t0 = time.perf_counter()
        simulate_replica(times, pp, 0.01, keep_events=False, vp=vp)
        run = time.perf_counter() - t0
        print(f"pp{pp} vp{vp}, {m} micro-batches ({2 * pp * vp * m:,} events): event order built in "
              f"{np.median(built) * 1e3:.1f} ms (median of 5), simulated in {run * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
    deep()
