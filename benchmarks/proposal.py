"""Strategy proposal against the best homogeneous deployment and the published DP's pool.

For each bench scenario, pools are proposed from sample batches (one seed)
and judged on fresh batches (another seed) with the same planner: throughput
of the proposed pool, of the published DP pool, and of the best single
homogeneous deployment that holds the run's longest sequence (chosen with
hindsight on the fresh batches, which favours it). Both pools are planned by
the `hydraulis` policy's planner, phases within an iteration included
(`PhasedPlanner`): the proposal adds deployments for phases that no whole
batch would choose, which a single-phase planner never uses. Also times proposal for
64 and 1024 GPUs. Targets: >= 1.1x over homogeneous, >= 1.0x over the
published pool, proposal <= 10 s (64 GPUs) and <= 60 s (1024 GPUs).

Run: .venv/bin/python benchmarks/proposal.py [--quick] [--scenarios NAME ...]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hydraulis.bench import Scenario, get_scenarios
from hydraulis.cost import load_cost_model
from hydraulis.errors import HydraulisError
from hydraulis.planner.phases import PhasedPlanner
from hydraulis.planner.planner import Planner
from hydraulis.planner.pool import homogeneous, usable_configs
from hydraulis.planner.proposal.propose import propose
from hydraulis.specs import ClusterSpec


def throughput(planner: Planner, batches: list[np.ndarray]) -> tuple[float, list[str]]:
    """Tokens/s of the planned iterations (phased, for a PhasedPlanner), and the deployment of every phase run."""
    tokens = sum(int(b.sum()) for b in batches)
    if isinstance(planner, PhasedPlanner):
        schedules = [planner.schedule(b) for b in batches]
        ran = [str(p.deployment) for s in schedules for p in s.phases]
        return tokens / sum(s.iteration_time_s for s in schedules), ran
    plans = [planner.plan(b) for b in batches]
    return tokens / sum(p.predicted_time_s for p in plans), [str(p.deployment) for p in plans]


def best_homogeneous(cost, cluster: ClusterSpec, batches: list[np.ndarray], longest: int) -> tuple[float, str]:
    best, name = 0.0, "-"
    for config in usable_configs(cost, cluster):
        if cost.cap(config, cluster.num_gpus) < longest or cluster.num_gpus % config.num_gpus:
            continue
        try:
            deployment = homogeneous(config, cluster)
        except HydraulisError:
            continue
        tps, _ = throughput(Planner(cost, cluster.num_gpus, [deployment]), batches)
        if tps > best:
            best, name = tps, str(deployment)
    return best, name


def run(scenario: Scenario, samples: int, fresh: int) -> dict:
    cost = load_cost_model(scenario.profile)
    cluster = ClusterSpec(scenario.num_gpus)
    train = scenario.sample(scenario.seed + 1000, samples)
    test = scenario.sample(scenario.seed, fresh)
    longest = max(int(b.max()) for b in train + test)
    row: dict = {"scenario": scenario.name}
    for method in ("hydraulis", "published"):
        t0 = time.perf_counter()
        result = propose(cost, cluster, train, method=method, max_length=longest)
        elapsed = time.perf_counter() - t0
        tps, chosen = throughput(PhasedPlanner(cost, cluster.num_gpus, result.pool.deployments), test)
        usage = {str(d): chosen.count(str(d)) for d in result.pool.deployments}
        row[method] = {"tokens_per_s": tps, "seconds": elapsed, "usage": usage}
    row["homogeneous"], row["homogeneous_deployment"] = best_homogeneous(cost, cluster, test, longest)
    return row


def timing(profile: str, num_gpus: int, tokens: int, mixture: str) -> float:
    scenario = Scenario("timing", profile, num_gpus, tokens, 32 * 1024, mixture)
    batches = scenario.sample(5, 8)
    t0 = time.perf_counter()
    propose(load_cost_model(profile), ClusterSpec(num_gpus), batches)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches, no 1024-GPU timing")
    parser.add_argument("--scenarios", nargs="*", help="bench scenario names (default: all)")
    args = parser.parse_args()
    samples, fresh = (4, 3) if args.quick else (8, 6)
    ratios_h, ratios_p = [], []
    for scenario in get_scenarios(args.scenarios):
        row = run(scenario, samples, fresh)
        ours, pub, hom = row["hydraulis"], row["published"], row["homogeneous"]
        ratios_h.append(ours["tokens_per_s"] / hom)
        ratios_p.append(ours["tokens_per_s"] / pub["tokens_per_s"])
        print(
            f"{scenario.name:24s} ours {ours['tokens_per_s']:>10,.0f} tok/s ({ours['seconds']:4.1f} s)  "
            f"vs homogeneous {ratios_h[-1]:.3f}x [{row['homogeneous_deployment']}]  "
            f"vs published {ratios_p[-1]:.3f}x ({pub['seconds']:4.1f} s)",
            flush=True,
        )
        for deployment, count in ours["usage"].items():
            print(f"{'':26s}ran in {count} phase(s) of {fresh} batches: {deployment}")
    gm = float(np.exp(np.mean(np.log(ratios_h))))
    print(f"geomean vs best homogeneous {gm:.3f}x (min {min(ratios_h):.3f}x; target >= 1.1x)")
    print(f"geomean vs published DP pool {float(np.exp(np.mean(np.log(ratios_p)))):.3f}x (min {min(ratios_p):.3f}x)")
    print(f"proposal time, 64 GPUs, 1M tokens: {timing('llama-7b@a800-80g', 64, 1 << 20, 'wiki'):.1f} s (<= 10 s)")
    if not args.quick:
        t = timing("llama-7b@a800-80g", 1024, 16 << 20, "wiki")
        print(f"proposal time, 1024 GPUs, 16M tokens: {t:.1f} s (<= 60 s)")


if __name__ == "__main__":
    main()
