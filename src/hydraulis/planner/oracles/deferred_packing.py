"""Packing for the deferred schedule: a plan's slowest replicas packed and ordered again on deferred times.

Packing chooses each replica's micro-batches and their order on the fused backward's 1F1B times
(`packing.fastest_packing`), and the deferral (`zero_bubble.defer_replica`) then fills that order's gaps; the
packing and order whose gaps a deferral fills best are often others (long-70b-256g: another micro-batch count, or
the large micro-batches last rather than in the middle, 0.4-0.9% faster). Only the slowest replica decides the
iteration, so once a plan is chosen its slowest replica's candidate packings (`packing.packing_candidates`, at its
caps and at its count's, as `pack_replica` makes them) are deferred in each of their orders, every deferral given
up once it cannot beat the best so far (`deferral.defer_slots`' beat), and the fastest is kept; then the next
slowest, until the slowest gains nothing. A replica is never slower than its deferred time before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.planner.oracles.deferral import defer_slots, split_backward
from hydraulis.planner.oracles.zero_bubble import replica_memory
from hydraulis.planner.packing import packing_candidates, packing_orders
from hydraulis.planner.plan import IterationPlan, ReplicaPlan
from hydraulis.planner.replicas import ReplicaCost, ReplicaTable
from hydraulis.planner.sim import replica_compute_s, replica_stage_times, simulate

# The deferral's overrun share in the search: a W may overrun its gap by up to 3/4 of itself (`finalize` tried 0 and
# 1/2 on the plan's own order). On long-70b-256g's two batches 3/4 alone found what 0, 1/2 and 3/4 together did
# (16.409 -> 16.346 s, 16.616 -> 16.471 s), at a third of the deferrals; 0 and 1/2 found 16.383 and 16.491 s.
SEARCH_SPILLS = (0.75,)


def _with(plan: IterationPlan, r: int, replica: ReplicaPlan) -> IterationPlan:
    return dataclasses.replace(plan, replicas=(*plan.replicas[:r], replica, *plan.replicas[r + 1 :]))


def _packings(plan: IterationPlan, r: int, replica: ReplicaCost,
              bulk: bool) -> tuple[tuple[list[np.ndarray], bool, bool], ...]:
    """Replica r's candidate packings (`pack_replica`'s: at its caps, then at its own count's), each with whether
    it is ramped and bulk (the orders it is tried in, `packing.packing_orders`)."""
    lengths = plan.lengths_array
    indices = np.concatenate([np.asarray(mb, dtype=np.int64) for mb in plan.replicas[r].micro_batches])
    found, bulk = packing_candidates(indices, lengths, replica, bulk)
    at = replica.at_count(len(plan.replicas[r].micro_batches))
    if at is not None and at.cap > replica.cap:
        found += [c for c in packing_candidates(indices, lengths, at, bulk)[0] if replica.fits(c[0], lengths)]
    return tuple((mbs, ramped, bulk) for mbs, ramped in found if mbs)


def _trials(plan: IterationPlan, r: int, cost: CostModel, replica: ReplicaCost, bulk: bool) -> Iterator[tuple]:
    """Replica r's candidate packings of at most its count in their orders, each as (micro-batches, policies, and
    per micro-batch F, B, W, p2p, bytes held and W's bytes held, then the cap), none twice by its costs (its own
    order's time is the beat). Each packing's stage times, split and memory are counted once, then permuted. More
    micro-batches than packing chose shrink a bubble the deferral fills anyway, at c each: on long-70b-256g none
    won, and they cost half the search."""
    config, lengths, count = replica.config, plan.lengths_array, len(plan.replicas[r].micro_batches)
    seen = {(tuple(replica_stage_times(plan, r, cost)[0]), tuple(replica_memory(plan, r, cost)[0]))}
    for mbs, ramped, bulky in _packings(plan, r, replica, bulk):
        if len(mbs) > count:
            continue
        batches = tuple(tuple(int(i) for i in mb) for mb in mbs)
        tokens = [int(lengths[mb].sum()) for mb in mbs]
        trial = _with(plan, r, ReplicaPlan(batches, tuple(int(p) for p in replica.policies_of(tokens))))
        times, comm = replica_stage_times(trial, r, cost)
        held, weight_held, cap = replica_memory(trial, r, cost)
        per = (*split_backward(config, cost, tokens, times), comm, held, weight_held)
        policies = trial.replicas[r].policies
        for o in (o.tolist() for o in packing_orders(np.asarray(times), ramped, bulky)):
            key = (tuple(times[j] for j in o), tuple(held[j] for j in o))  # equal costs defer alike
            if key not in seen:
                seen.add(key)
                yield (tuple(batches[j] for j in o), tuple(policies[j] for j in o) if policies else (),
                       *([x[j] for j in o] for x in per), cap)


def faster_replica(plan: IterationPlan, r: int, cost: CostModel, replica: ReplicaCost, bulk: bool,
                   beat: float) -> tuple[ReplicaPlan, float] | None:
    """Replica r's packing, order and deferral (`defer_slots` over `SEARCH_SPILLS`) that takes least, where that is
    below `beat`; None where none is."""
    config = replica.config
    best: tuple[ReplicaPlan, float] | None = None
    for batches, policies, f, b, w, c, h, hw, cap in _trials(plan, r, cost, replica, bulk):
        for spill in SEARCH_SPILLS:
            slots, t = defer_slots(f, b, w, config.pp, vp=config.vp, p2p_s=c, held=h, weight_held=hw, cap=cap,
                                   fused_s=np.inf, spill=spill, beat=beat if best is None else best[1])
            if any(slots) and t < (beat if best is None else best[1]):
                best = ReplicaPlan(batches, policies, slots), t
    return best


def defer_faster(plan: IterationPlan, cost: CostModel, table: ReplicaTable, bulk: bool = False) -> IterationPlan:
    """`plan` with its slowest replicas packed and ordered again for the deferral (module docstring), its predicted
    times the simulator's; `plan` itself where that gains nothing. `table`: the deployment's (`ReplicaTable.of`),
    `bulk` as packing had it (a large batch of light sequences)."""
    if cost.shared_cores is not None:  # a joint simulation that runs the fused order
        return plan
    times = replica_compute_s(plan, cost)
    tried, out = set(), plan
    while True:
        r = int(np.argmax(times))
        if r in tried or table.replicas[r].pp == 1 or not out.replicas[r].micro_batches:
            break
        tried.add(r)
        found = faster_replica(out, r, cost, table.replicas[r], bulk, times[r])
        if found is None:
            break
        out, times[r] = _with(out, r, found[0]), found[1]
    if out is plan:
        return plan
    sim = simulate(out, cost, keep_events=False)
    if sim.iteration_time_s >= plan.predicted_time_s:  # the greedy's times are the simulator's: a guard
        return plan
    out.validate(cost, plan.deployment.num_gpus, where=f"step {plan.step}")
    return dataclasses.replace(out, predicted_time_s=sim.iteration_time_s,
                               replica_predicted_s=tuple(float(t) for t in sim.replica_times_s))
