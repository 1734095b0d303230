"""The zero-bubble oracle (issue 50, item 3): a plan's own (interleaved) 1F1B with each backward split into B, the
input gradients on the critical path, and W, the weight gradients, which may wait for a gap.

Every stage runs its forwards and B's in the plan's order (`pipeline_order.stage_order`, vp chunks per stage) and
its pending W's, oldest first, in the idle time before its next event's input arrives, never delaying an F or a B
(Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, without their hand-made order). A deferred W holds its
chunk's linear layers' inputs and output gradients (`weight_grad_bytes`) until it ends, where its B freed the rest
of the chunk's activations; before an event would lift a stage above its memory cap, the oldest pending W's run
first (the cap binds). A W may stop and resume between gaps (at layer granularity in a runtime; here in any
fraction): so a stage's clock plus its pending W's never passes interleaved 1F1B's clock, and the oracle is never
slower than the plan's own order. Greedy list scheduling: an oracle of what the schedule could gain, not an
optimum (on pp 4, 8 equal micro-batches of F = B = W = 1 at 1F1B's memory it takes 30 where ZB-H1 takes 27). The
continuous bound of `deferral.py`'s schedule, whose whole W's the planner places by the same rule (`defer_plan`,
at the end of this module, with the memory this module counts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.context import max_rank_tokens
from hydraulis.cost.activations import in_flight
from hydraulis.cost.model import CostModel
from hydraulis.cost.policies import MemoryPolicy
from hydraulis.pipeline_order import FORWARD, event_graph
from hydraulis.planner.oracles.deferral import defer_slots, deferred_peak, order_peak, split_backward
from hydraulis.planner.plan import IterationPlan
from hydraulis.planner.sim import replica_stage_times, simulate_replica
from hydraulis.specs import ModelSpec

_EPS = 1e-9  # relative slack of a memory comparison (sums of bytes in another order)


@dataclass(frozen=True)
class ZeroBubbleRun:
    """One replica under the oracle: its time, each stage's most bytes held (the memory unit given), and seconds
    of W work in all, run after a later F or B of its stage (deferred), and run early because the cap bound."""

    time_s: float
    peak: tuple[float, ...]
    weight_s: float
    deferred_s: float
    forced_s: float
    forced: int  # W's the cap made run before an event


class _Stage:
    """A stage's clock, bytes held and pending W's ([micro-batch, work left, bytes, still fresh]), oldest first."""

    def __init__(self, cap: float) -> None:
        self.clock = self.held = self.peak = 0.0
        self.cap = cap
        self.pending: list[list] = []
        self.deferred = self.forced_s = 0.0
        self.forced = 0

    def run(self, until: float | None = None) -> None:
        """The oldest pending W: whole (`until` None), or as much of it as ends by `until`."""
        w = self.pending[0]
        work = w[1] if until is None else min(w[1], until - self.clock)
        self.deferred += 0.0 if w[3] else work
        if until is not None and work < w[1]:
            w[1] -= work
            self.clock = until
            return
        self.clock += w[1]
        self.held -= w[2]
        self.pending.pop(0)

    def make_room(self, delta: float = 0.0) -> None:
        """Run the oldest W's while an event adding `delta` bytes would hold (or the stage holds) more than the cap."""
        while self.pending and self.held + delta > self.cap * (1 + _EPS):
            self.forced_s += self.pending[0][1]
            self.forced += 1
            self.run()

    def fill(self, ready: float) -> None:
        """Pending W's in the gap before `ready`, never past it."""
        while self.pending and self.clock < ready:
            self.run(ready)


def zero_bubble_replica(
    forward_s: Sequence[float], input_grad_s: Sequence[float], weight_grad_s: Sequence[float], pp: int,
    vp: int = 1, p2p_s: Sequence[float] | float = 0.0, held: Sequence[float] | None = None,
    weight_held: Sequence[float] | None = None, cap: Sequence[float] | None = None,
) -> ZeroBubbleRun:
    """The replica's time under the oracle: forward, B and W seconds of each micro-batch on one stage (all vp
    chunks), p2p as the simulator's; one chunk's activations (`held`) and its deferred W's bytes (`weight_held`)
    per micro-batch, both 1 by default; each stage's cap (default and floor: what the plan's own order holds,
    `order_peak`, so at vp = 1 and the defaults 1F1B's pp - s micro-batches). Bytes held are counted between
    events, as `order_peak` counts them."""
    m = len(forward_s)
    held = [1.0] * m if held is None else list(map(float, held))
    weight_held = held if weight_held is None else list(map(float, weight_held))
    own = order_peak(pp, vp, held)
    caps = own if cap is None else [max(c, o) for c, o in zip(cap, own, strict=True)]
    comm = np.broadcast_to(np.asarray(p2p_s, dtype=np.float64), (m,)).tolist()
    g = event_graph(pp, vp, m)
    stages = [_Stage(c) for c in caps]
    end = [0.0] * len(g.stage)
    for e, (s, kind, j, d) in enumerate(zip(g.stage, g.kind, g.micro_batch, g.dep, strict=True)):
        ready = 0.0 if d < 0 else end[d] + (comm[j] if g.stage[d] != s else 0.0)
        stage = stages[s]
        if kind == FORWARD:
            stage.make_room(held[j])
        stage.fill(ready)
        for w in stage.pending:
            w[3] = False  # run after this event from here on: deferred
        start = stage.clock if stage.clock > ready else ready
        end[e] = stage.clock = start + (forward_s[j] if kind == FORWARD else input_grad_s[j]) / vp
        if kind == FORWARD:
            stage.held += held[j]
        else:  # the chunk's activations give way to what its W keeps; more than the cap: W's run now, its own last
            stage.held += weight_held[j] - held[j]
            stage.pending.append([j, weight_grad_s[j] / vp, weight_held[j], True])
            stage.make_room()
        stage.peak = max(stage.peak, stage.held)
    for stage in stages:
        while stage.pending:
            stage.run()
    return ZeroBubbleRun(
        time_s=max(stage.clock for stage in stages), peak=tuple(stage.peak for stage in stages),
        weight_s=pp * float(np.sum(weight_grad_s)), deferred_s=sum(stage.deferred for stage in stages),
        forced_s=sum(stage.forced_s for stage in stages), forced=sum(stage.forced for stage in stages),
    )


# -- the plan's split and memory, from the cost and memory models ---------------------------------------------


def zero_bubble_split(plan: IterationPlan, replica: int, cost: CostModel) -> tuple[list[float], ...]:
    """Each micro-batch's forward, B and W seconds on one stage (`deferral.split_backward`)."""
    return _split(plan, replica, cost, replica_stage_times(plan, replica, cost)[0])


def _split(plan: IterationPlan, replica: int, cost: CostModel, times: Sequence[float]) -> tuple[list[float], ...]:
    """`zero_bubble_split` of the micro-batches' stage `times` (the simulator's, `replica_stage_times`)."""
    tokens = [int(s.sum()) for s in plan.micro_batch_lengths(replica)]
    return split_backward(plan.deployment.replicas[replica].config, cost, tokens, times)


def weight_grad_bytes(model: ModelSpec, tp: int, dtype_bytes: int) -> float:
    """Per token and layer on a TP rank: what a deferred W keeps, each linear layer's input and output gradient
    (cost/activations.py's tensors): q/k/v's and w1/w3's input (the norms' outputs, hidden each), o_proj's (q
    columns) and w2's (ffn / tp); the gradients of q/k/v (q + 2 kv), o_proj (hidden), w1 and w3 (2 ffn / tp) and
    w2 (hidden). Without sequence parallelism (the hidden-wide ones are whole on every TP rank)."""
    q = model.heads * model.head_dim / tp
    kv = model.kv_heads * model.head_dim / tp
    f = model.ffn / tp
    return dtype_bytes * ((2 * model.hidden + q + f) + (q + 2 * kv + 2 * model.hidden + 2 * f))


def replica_memory(plan: IterationPlan, replica: int, cost: CostModel) -> tuple[list[float], list[float], list[float]]:
    """Per micro-batch, one chunk's activations under its policy (the memory model's count of one more chunk in
    flight) and its deferred W's bytes; per stage, the cap: the room the plan's cap leaves the first stage, its
    chunks in flight at the plan's count each at the micro-batch cap's tokens (the least over the replica's
    policies), in the same count. Every stage gets it: the ranks have the same memory and about the same state
    (L / pp layers), and the first stage holds the most in flight (the last stage's head is left out)."""
    config = plan.deployment.replicas[replica].config
    memory, model = cost.memory, cost.model
    d = memory.compute_dtype_bytes
    lengths = plan.micro_batch_lengths(replica)
    m = len(lengths)
    policies = [cost.policy_run(config, plan.policy(replica, k)) for k in range(m)]

    def chunk(tokens: int, policy: MemoryPolicy) -> float:
        two, one = (memory.activation_bytes(config, model, tokens, recompute=policy, held=k, dtype_bytes=d)
                    for k in (2, 1))
        return two - one

    held = [chunk(int(s.sum()), p) for s, p in zip(lengths, policies, strict=True)]
    per_token = model.layers // (config.pp * config.vp) * weight_grad_bytes(model, config.tp, d)
    weight_held = [max_rank_tokens(int(s.sum()), config.cp) * per_token for s in lengths]
    room = min(chunk(cost.micro_batch_cap(config, plan.deployment.num_gpus, m, p), p) for p in set(policies))
    return held, weight_held, [in_flight(config, 0, m) * room] * config.pp


def replica_oracle(plan: IterationPlan, replica: int, cost: CostModel, capped: bool = True) -> ZeroBubbleRun:
    """One replica of a plan under the oracle, its split and memory from the cost model (`capped` off: memory
    without bound, what the W's alone could gain)."""
    config = plan.deployment.replicas[replica].config
    times, comm = replica_stage_times(plan, replica, cost)
    forward, input_grad, weight = _split(plan, replica, cost, times)
    held, weight_held, cap = replica_memory(plan, replica, cost)
    return zero_bubble_replica(forward, input_grad, weight, config.pp, vp=config.vp, p2p_s=comm, held=held,
                               weight_held=weight_held, cap=cap if capped else [np.inf] * config.pp)


# -- the schedule the planner plans: whole W's in the gaps (deferral.py), where it is faster ------------------
# The greedy's overrun shares tried per replica, the faster kept: a W that does not fit its gap waits, or overruns
# it by up to half of itself (on 70B replicas of 40-100 micro-batches, half gained up to 0.7% over waiting alone on
# some, lost up to 0.02% on others; docs/results.md, h-zbplan).
SPILLS = (0.0, 0.5)


def defer_replica(plan: IterationPlan, replica: int, cost: CostModel) -> tuple[tuple[int, ...], ...]:
    """One replica's deferral (`deferral.defer_slots`, the cap `replica_memory`'s); none (()) where deferring is
    not faster than the plain order: a pipelined replica only, off shared CPU cores (whose joint simulation runs
    the fused order)."""
    config = plan.deployment.replicas[replica].config
    if config.pp == 1 or not plan.replicas[replica].micro_batches or cost.shared_cores is not None:
        return ()
    times, comm = replica_stage_times(plan, replica, cost)
    plain = simulate_replica(times, config.pp, comm, keep_events=False, vp=config.vp).time_s  # often kept
    forward, input_grad, weight = _split(plan, replica, cost, times)
    held, weight_held, cap = replica_memory(plan, replica, cost)
    best: tuple[tuple[tuple[int, ...], ...], float] = ((), plain)
    for spill in SPILLS:  # each given up once it cannot beat the best before it (the first of equal times kept)
        found = defer_slots(forward, input_grad, weight, config.pp, vp=config.vp, p2p_s=comm, held=held,
                            weight_held=weight_held, cap=cap, fused_s=plain, spill=spill, beat=best[1])
        best = found if found[1] < best[1] else best
    return best[0] if any(best[0]) else ()


def defer_plan(plan: IterationPlan, cost: CostModel) -> IterationPlan:
    """The plan with each replica's W's deferred where that is faster (`defer_replica`); its predicted times are
    left to the caller's simulation (`sim.simulate` times the deferred order)."""
    replicas = tuple(dataclasses.replace(r, deferral=defer_replica(plan, k, cost))
                     for k, r in enumerate(plan.replicas))
    return dataclasses.replace(plan, replicas=replicas)


def deferral_errors(plan: IterationPlan, cost: CostModel) -> str | None:
    """A replica whose deferred W's would hold more bytes than its cap (`replica_memory`) at some event (None:
    every one within it): the plan's memory check of a deferral."""
    for r, replica in enumerate(plan.replicas):
        if not replica.deferral:
            continue
        config = plan.deployment.replicas[r].config
        held, weight_held, cap = replica_memory(plan, r, cost)
        peaks = deferred_peak(config.pp, config.vp, held, weight_held, replica.deferral)
        own = order_peak(config.pp, config.vp, held)
        for s, (peak, c, o) in enumerate(zip(peaks, cap, own, strict=True)):
            if peak > max(c, o) * (1 + 1e-6):
                return (f"replica {r} ({config.name}) stage {s} holds {peak / 2**30:.2f} GiB with its deferred "
                        f"weight gradients, over the {max(c, o) / 2**30:.2f} GiB its cap leaves")
    return None
