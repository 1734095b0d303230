"""The zero-bubble oracle on the plan's own order against (interleaved) 1F1B on the bench's plans (issue 50, item 3).

Per scenario, hydraulis plans the bench's batches as `hydraulis bench` has it (policies per micro-batch, with and
without full recompute where needed, interleaved and plain 1F1B: the fastest). Each phase's replicas then run
their micro-batches, as planned and in the plan's (interleaved) order, under the zero-bubble oracle of
`planner/oracles/zero_bubble.py` (each backward split into B and W, the W's deferred into the stages' gaps within
the plan's memory cap); the exchange, switches and step stay. Printed per scenario: the plan's time, the
oracle's, the gain, and the gain without a memory cap; over the pipelined replicas, the W's share of the plain
backward by the cost model and by the model's FLOPs (a check of the split), the share of the W seconds deferred
past a later F or B and of those run early because the cap bound, and in how many replicas' phases it bound; the
share of compute's GPU seconds the oracle frees on the replicas as planned (a planner that knew the oracle could
rebalance them; the gain above keeps the plan). Simulated: load does not move the figures. Replicas of pp = 1 gain
nothing by construction (no gap: every W waits for the end or the cap at no cost), so plans that are all pp = 1
gain nothing.

    PYTHONPATH=src python benchmarks/zero_bubble_oracle.py [SCENARIO ...]
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter

import numpy as np

from hydraulis.baselines import make_policy
from hydraulis.bench import geomean, get_scenarios, hydraulis_contexts
from hydraulis.cost import load_cost_model
from hydraulis.cost.model import FORWARD_SHARE, CostModel
from hydraulis.cost.policies import derived_scales
from hydraulis.planner.oracles.zero_bubble import replica_oracle, zero_bubble_split
from hydraulis.planner.plan import IterationPlan, Schedule
from hydraulis.planner.policy import PolicyContext
from hydraulis.planner.schedule import check_schedule
from hydraulis.planner.sim import simulate
from hydraulis.specs import ClusterSpec

# The bench's scenarios whose hydraulis plans run pipelines (docs/results.md: the bench after 2026-12-07's merges,
# and the main group's deployments under interleaved 1F1B); every other plans pp = 1 only.
PIPELINED = ("long-70b-64g-stdlib-1m-64k", "long-70b-128g-longmix-2m-128k", "long-70b-256g-longmix-4m-64k",
             "32b-64g-wiki-1m-32k", "32b-64g-wikisample-1m-32k", "32b-16g-code-256k-16k")


def plan_batches(ctx: PolicyContext, batches: list[np.ndarray]) -> tuple[CostModel, list[Schedule]]:
    """Hydraulis's schedule of each batch in `ctx`, checked (every sequence once, caps held), and its cost model."""
    policy = make_policy("hydraulis", ctx)
    schedules = [policy.schedule(b, step) for step, b in enumerate(batches)]
    for schedule in schedules:
        check_schedule(schedule, policy.cost)
    return policy.cost, schedules


def plan_bench(scenario) -> tuple[CostModel, list[float], list[Schedule]]:
    """The bench's hydraulis on the scenario's batches (the fastest of `hydraulis_contexts`, interleaving on as
    `hydraulis bench` runs by default): its cost model, iteration times and schedules."""
    batches = scenario.sample(scenario.seed)
    ctx = PolicyContext.build(load_cost_model(scenario.profile), ClusterSpec(scenario.num_gpus), batches,
                              sample=scenario.sample(scenario.seed + 1000, 4))
    cost, schedules = min((plan_batches(c, batches) for c in hydraulis_contexts(
        dataclasses.replace(ctx, interleave=True))), key=lambda r: sum(k.iteration_time_s for k in r[1]))
    return cost, [k.iteration_time_s for k in schedules], schedules


def weight_shares(plan: IterationPlan, replica: int, cost: CostModel) -> tuple[float, float, float]:
    """Per replica, sums of micro-batches' plain backward seconds (no policy's recompute: 2/3 of a s^2 + b s) and
    of W's share of them by the cost model (`zero_bubble_split`) and by the model's FLOPs (the GEMMs' weight
    gradients, one forward's GEMMs, over two forwards' GEMMs and attention, as slime's `forward_flops` counts
    them); the two shares should agree where b is the GEMMs' work."""
    config = plan.deployment.replicas[replica].config
    model, k = cost.model, cost.coefficients(config)
    scale_a, scale_b = derived_scales(model)[cost.policies(config)[0]]  # a run-wide policy's, in a and b already
    _, _, weight = zero_bubble_split(plan, replica, cost)
    gemm = 2.0 * (model.params_per_layer - 2 * model.hidden)
    attention = 2.0 * model.heads * model.head_dim
    out = np.zeros(3)
    for w, s in zip(weight, plan.micro_batch_lengths(replica), strict=True):
        n, squares = float(s.sum()), float(np.dot(s, s))
        backward = (1 - FORWARD_SHARE) * (k.a / scale_a * squares + k.b / scale_b * n)
        out += (backward, w, backward * gemm * n / (2 * (gemm * n + attention * squares)))
    return tuple(out)


def oracle_schedule(schedule: Schedule, cost: CostModel) -> Counter:
    """The schedule's iteration with each phase's compute under the oracle (the rest as simulated), also without
    a memory cap; figures summed over its pipelined replicas' phases: plain backward, W and W-by-FLOPs seconds
    (per stage), W seconds deferred and forced by the cap (per stage), phases where the cap bound; the GPU seconds of
    compute, and those the oracle frees on the replicas as planned (what a planner that knew it could rebalance)."""
    out: Counter = Counter(time=schedule.iteration_time_s, uncapped=schedule.iteration_time_s)
    for p, plan in enumerate(schedule.phases):
        phase_cost = cost if p == 0 else cost.later_phase()
        simulated = simulate(plan, phase_cost, keep_events=False)
        compute = uncapped = 0.0
        for r, replica in enumerate(plan.deployment.replicas):
            if not plan.micro_batch_lengths(r):
                continue
            run = replica_oracle(plan, r, phase_cost)
            compute = max(compute, run.time_s)
            uncapped = max(uncapped, replica_oracle(plan, r, phase_cost, capped=False).time_s)
            config = replica.config
            out.update(replicas=1, freed=config.num_gpus * (simulated.timelines[r].time_s - run.time_s))
            if config.pp > 1:  # one stage has no gap: its W's wait for the end or the cap, at no cost
                backward, weight, by_flops = weight_shares(plan, r, phase_cost)
                out.update(backward=backward, weight=weight, weight_by_flops=by_flops, pipelined=1,
                           deferred=run.deferred_s / config.pp, forced=run.forced_s / config.pp, bound=run.forced > 0,
                           interleaved=config.vp > 1)
        out.update(time=compute - simulated.compute_time_s, uncapped=uncapped - simulated.compute_time_s,
                   gpu_s=plan.deployment.num_gpus * simulated.compute_time_s)
    return out


def main(args: list[str]) -> int:
    gains = []
    for s in get_scenarios(args or PIPELINED):
        cost, times, schedules = plan_bench(s)
        plan_s = float(sum(times))
        sums: Counter = Counter()
        for k in schedules:
            sums.update(oracle_schedule(k, cost))
        gains.append(plan_s / sums["time"])
        w, backward = sums["weight"] or 1.0, sums["backward"] or 1.0
        print(f"{s.name}: plan {plan_s:.2f} s, oracle {sums['time']:.2f} s, gain {gains[-1]:.4f}x (without a cap "
              f"{plan_s / sums['uncapped']:.4f}x); W {sums['weight'] / backward:.1%} of the plain backward "
              f"(by FLOPs {sums['weight_by_flops'] / backward:.1%}), deferred {sums['deferred'] / w:.1%}, "
              f"forced by the cap {sums['forced'] / w:.1%}; the cap bound in {sums['bound']} of the "
              f"{sums['pipelined']} pipelined replicas' phases ({sums['interleaved']} interleaved) of "
              f"{sums['replicas']}; GPU time freed {sums['freed'] / sums['gpu_s']:.2%} of compute's", flush=True)
    print(f"geometric mean gain: {geomean(gains):.4f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
