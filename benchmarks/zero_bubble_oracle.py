"""The zero-bubble oracle against interleaved 1F1B on the bench's long scenarios (issue 50, item 3).

Per scenario, hydraulis plans the bench's batches as the bench has it (interleaving on: its proposal and planner
weigh every vp of the recipes). Each phase's replicas then run their micro-batches, as planned, under the
zero-bubble oracle of `planner/sim.py` (`zero_bubble_replica`: the backward split into B and W, W's of unequal
micro-batches fitted into the gaps, at most 1F1B's micro-batches held, on the config's plain pipeline) instead
of the plan's (interleaved) 1F1B; the exchange, switches and step stay. Printed: the plan's time, the oracle's,
their ratio (what the schedule could gain on these plans), and the share of the plan's replicas that were
interleaved. Simulated: load does not move the figures.

    PYTHONPATH=src python benchmarks/zero_bubble_oracle.py [SCENARIO ...]
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from hydraulis.baselines import make_policy
from hydraulis.bench import geomean, get_scenarios, hydraulis_contexts
from hydraulis.cost import load_cost_model
from hydraulis.cost.model import CostModel
from hydraulis.planner.plan import IterationPlan, Schedule
from hydraulis.planner.policy import PolicyContext
from hydraulis.planner.schedule import check_schedule
from hydraulis.planner.sim import replica_stage_times, simulate, zero_bubble_replica, zero_bubble_split
from hydraulis.specs import ClusterSpec


def oracle_compute(plan: IterationPlan, cost) -> float:
    """The phase's compute under the oracle: its slowest replica's."""
    out = 0.0
    for r, replica in enumerate(plan.deployment.replicas):
        if not plan.micro_batch_lengths(r):
            continue
        forward, input_grad, weight = zero_bubble_split(plan, r, cost)
        _, comm = replica_stage_times(plan, r, cost)
        out = max(out, zero_bubble_replica(forward, input_grad, weight, replica.config.pp, comm)[0])
    return out


def oracle_time(schedule: Schedule, cost) -> float:
    """The schedule's iteration with each phase's compute under the oracle, the rest as simulated."""
    total = schedule.iteration_time_s
    for plan in schedule.phases:
        total += oracle_compute(plan, cost) - simulate(plan, cost, keep_events=False).compute_time_s
    return total


def plan_batches(ctx: PolicyContext, batches: list[np.ndarray]) -> tuple[CostModel, list[Schedule]]:
    """Hydraulis's schedule of each batch in `ctx`, checked (every sequence once, caps held), and its cost model."""
    policy = make_policy("hydraulis", ctx)
    schedules = [policy.schedule(b, step) for step, b in enumerate(batches)]
    for schedule in schedules:
        check_schedule(schedule, policy.cost)
    return policy.cost, schedules


def main(args: list[str]) -> int:
    ratios = []
    for s in get_scenarios(args or None, None if args else "long"):
        batches = s.sample(s.seed)
        ctx = PolicyContext.build(load_cost_model(s.profile), ClusterSpec(s.num_gpus), batches,
                                  sample=s.sample(s.seed + 1000, 4))
        # The bench's hydraulis: the fastest of its contexts (a memory policy per micro-batch, interleaving on).
        cost, schedules = min((plan_batches(c, batches) for c in hydraulis_contexts(
            dataclasses.replace(ctx, interleave=True))), key=lambda r: sum(k.iteration_time_s for k in r[1]))
        plan_s = float(sum(k.iteration_time_s for k in schedules))
        zb_s = float(sum(oracle_time(k, cost) for k in schedules))
        replicas = [r.config.vp for k in schedules for p in k.phases for r in p.deployment.replicas]
        ratios.append(plan_s / zb_s)
        print(f"{s.name}: plan {plan_s:.2f} s, zero-bubble oracle {zb_s:.2f} s, {plan_s / zb_s:.3f}x; "
              f"{np.mean([v > 1 for v in replicas]):.0%} of the plan's replicas interleaved", flush=True)
    print(f"geometric mean: {geomean(ratios):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
