"""The length-aware zero-bubble schedule (planner/oracles/deferral.py): valid slots, timed exactly (against a plain
per-event simulation of the expanded stage orders), never slower than the fused backward, within the memory cap;
carried by the plan (JSON, wire format) and planned by the planner."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment
from hydraulis.pipeline_order import BACKWARD, FORWARD, WEIGHT, depends_on, stage_order, with_weights
from hydraulis.planner.oracles.deferral import defer_slots, deferred_peak, order_peak, slot_errors, time_deferred
from hydraulis.planner.oracles.zero_bubble import deferral_errors, replica_memory
from hydraulis.planner.plan import IterationPlan, decode_plan, encode_plan
from hydraulis.planner.planner import Planner
from hydraulis.planner.schedule import Schedule, check_schedule
from hydraulis.planner.sim import simulate, simulate_replica
from hydraulis.specs import ClusterSpec


def per_event(forward, input_grad, weight, pp, vp, comm, slots) -> float:
    """Each stage's expanded order (`with_weights`) run by sweeping the stages, each event when its stage is free
    and its input (`depends_on`, plus the send between stages) has arrived; a fused stage's backward is B + W, sent
    after both. Written from the definitions, apart from `time_deferred`'s topological loop."""
    m = len(forward)
    orders = [with_weights(stage_order(pp, vp, m, s), slots[s] if slots else ()) for s in range(pp)]
    done: dict[tuple[int, int, int, int], float] = {}  # (stage, kind, chunk, micro-batch) -> when its output is out
    clock, nxt = [0.0] * pp, [0] * pp
    while any(nxt[s] < len(orders[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            while nxt[s] < len(orders[s]):
                kind, j, c = orders[s][nxt[s]]
                ready = 0.0
                if kind != WEIGHT:
                    on = depends_on(pp, vp, s, kind, c)
                    if on is not None:
                        if (*on, j) not in done:
                            break
                        ready = done[(*on, j)] + (comm[j] if on[0] != s else 0.0)
                fused = kind == BACKWARD and not (slots and slots[s])
                work = {FORWARD: forward[j], BACKWARD: input_grad[j] + (weight[j] if fused else 0.0),
                        WEIGHT: weight[j]}[kind] / vp
                clock[s] = max(clock[s], ready) + work
                if kind != WEIGHT:
                    done[(s, kind, c, j)] = clock[s]
                nxt[s] += 1
                moved = True
        assert moved, "the expanded orders deadlocked"
    return max(clock)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-3, 20.0), st.floats(0.1, 4.0), st.floats(0.1, 4.0)), min_size=1, max_size=12),
       st.integers(1, 5), st.integers(1, 3), st.floats(0.0, 0.3), st.floats(0.0, 0.5), st.floats(1.0, 2.0),
       st.sampled_from([0.0, 0.5, 1.0]))
def test_slots_are_valid_timed_exactly_never_slower_and_within_the_cap(
    micro_batches, pp, vp, comm, share, room, spill
):
    """Unequal micro-batches, bytes, caps and overrun shares: each stage's slots valid (one per backward,
    nondecreasing, each at or after its B), the greedy's time the timed order's and the independent per-event
    simulation's, never above the fused order's (the simulator's 1F1B), and each stage's bytes, after every event
    and its W's, within its cap."""
    vp = vp if pp > 1 else 1
    times = [t for t, _, _ in micro_batches]
    held = [h for _, h, _ in micro_batches]
    weight_held = [w for _, _, w in micro_batches]
    forward = [t / 3 for t in times]
    weight = [t * 2 / 3 * share for t in times]
    input_grad = [t * 2 / 3 - w for t, w in zip(times, weight, strict=True)]
    cap = [p * room for p in order_peak(pp, vp, held)]
    slots, time_s = defer_slots(forward, input_grad, weight, pp, vp=vp, p2p_s=comm, held=held,
                                weight_held=weight_held, cap=cap, spill=spill)
    m = len(times)
    assert slot_errors(slots, pp, vp, m) is None
    for s, own in enumerate(slots):
        backwards = [k for k, (kind, _, _) in enumerate(stage_order(pp, vp, m, s)) if kind == BACKWARD]
        assert not own or (len(own) == len(backwards) and list(own) == sorted(own)
                           and all(x >= b for x, b in zip(own, backwards, strict=True)))
    plain = simulate_replica(times, pp, comm, vp=vp).time_s
    assert time_s <= plain * (1 + 1e-12)
    if pp > 1:
        assert time_deferred(forward, input_grad, weight, pp, slots, vp=vp, p2p_s=[comm] * m)[0] == time_s
        assert per_event(forward, input_grad, weight, pp, vp, [comm] * m, slots) == pytest.approx(time_s, rel=1e-12)
    peaks = deferred_peak(pp, vp, held, weight_held, slots)
    assert all(p <= c * (1 + 1e-9) for p, c in zip(peaks, cap, strict=True))


def test_on_four_stages_deferring_the_long_micro_batchs_w_gains():
    """pp 4, micro-batches of 4, 1, 1, 1 and 4 (F = t/3, B = W = t/3), ample memory. Fused, each stage's backward
    of a long micro-batch holds its input gradient for W's 4/3 before sending it upstream, on each of the 3 stages
    the backward chain crosses: deferred, those W's wait for the gaps (or the end), so the chain is shorter; the
    last short forwards' gaps hold them. The timed order is the per-event simulation's, and faster than 1F1B."""
    times = [4.0, 1.0, 1.0, 1.0, 4.0]
    third = [t / 3 for t in times]
    plain = simulate_replica(times, 4).time_s
    slots, time_s = defer_slots(third, third, third, 4, cap=[1e9] * 4)
    assert any(slots) and time_s == pytest.approx(per_event(third, third, third, 4, 1, [0.0] * 5, slots))
    assert plain - time_s >= 4 / 3 - 1e-9  # at least one long W off the critical chain
    assert per_event(third, third, third, 4, 1, [0.0] * 5, ()) == pytest.approx(plain)  # fused: the simulator's


def test_with_weights_expands_slots_and_fused_is_the_order_itself():
    order = stage_order(2, 1, 3, 0)  # F0 F1 B0 F2 B1 B2
    assert with_weights(order, ()) == tuple(order)
    out = with_weights(order, (2, 5, 5))
    assert out == (*order[:3], (WEIGHT, 0, 0), *order[3:], (WEIGHT, 1, 0), (WEIGHT, 2, 0))
    assert slot_errors(((2, 5, 5), ()), 2, 1, 3) is None
    assert "before its backward" in slot_errors(((1, 5, 5), ()), 2, 1, 3)
    assert slot_errors(((4, 3, 5), ()), 2, 1, 3) is not None  # decreasing
    assert "weight slots for" in slot_errors(((2, 5), ()), 2, 1, 3)


@pytest.fixture(scope="module")
def seventy():
    return load_cost_model("llama-70b@h100-80g+cp").with_interleaving().with_policies(True)


def test_the_planner_defers_where_faster_the_plan_carries_it_and_its_memory_holds(seventy):
    """A 70B batch planned on one interleaved pipelined deployment with and without the switch: the same
    micro-batches, the deferred plan no slower, its predicted time the simulator's of its deferred order, within
    the memory check; its deferral survives the JSON and the wire format; a deferral above the cap is refused."""
    deployment = Deployment.parse("1x(tp4,pp4,cp4,vp5)", ClusterSpec(64))
    lengths = np.array([65536, 24576, 12288, 8192, 4096, 4096, 2048, 12288, 30000, 1024, 3000, 16000])
    fused = Planner(seventy, 64, [deployment]).plan_on(lengths, deployment)
    planned = Planner(seventy, 64, [deployment], zero_bubble=True).plan_on(lengths, deployment)
    assert [r.micro_batches for r in planned.replicas] == [r.micro_batches for r in fused.replicas]
    assert planned.replicas[0].deferral and planned.predicted_time_s < fused.predicted_time_s
    assert simulate(planned, seventy, keep_events=False).iteration_time_s == planned.predicted_time_s
    check_schedule(Schedule.single(planned), seventy)
    rows = simulate(planned, seventy).timelines[0].events
    assert (rows[:, 2] == WEIGHT).sum() == 4 * 5 * len(planned.replicas[0].micro_batches)
    back = IterationPlan.from_dict(planned.to_dict(), ClusterSpec(64), "plan")
    assert back.replicas == planned.replicas
    bad = planned.to_dict()
    bad["replicas"][0]["deferral"][1][0] = 0  # stage 1's first W before its backward
    with pytest.raises(HydraulisError, match=r"plan: replica 0 \(tp4pp4cp4vp5\) deferral: stage 1: weight slot 0"):
        IterationPlan.from_dict(bad, ClusterSpec(64), "plan")
    wire = decode_plan(encode_plan(planned, 0), 0, planned.lengths, [deployment])
    assert wire.replicas == planned.replicas and wire.predicted_time_s == planned.predicted_time_s
    held, weight_held, cap = replica_memory(planned, 0, seventy)
    late = tuple((2 * len(s) - 1,) * len(s) for s in planned.replicas[0].deferral)  # every W at the end
    hoarding = dataclasses.replace(planned, replicas=(dataclasses.replace(planned.replicas[0], deferral=late),))
    assert max(deferred_peak(4, 5, held, weight_held, late)) > cap[0]  # every W kept to the end
    assert "over the" in deferral_errors(hoarding, seventy)
    with pytest.raises(HydraulisError, match="GiB"):
        check_schedule(Schedule.single(hoarding), seventy)


def test_the_planner_chooses_the_deployment_on_deferred_times(seventy):
    """A batch whose fused plans rank `1x(tp8,pp2,cp4)` first (3.735 s against 4.404 s) and whose deferred plans rank
    the interleaved `2x(tp4,pp4,cp2,vp5)` first (3.627 s against 3.636 s): with the switch the planner picks the
    deferred fastest, that deployment's own deferred plan (`plan_on`, the same packed candidate through the memo)."""
    cluster = ClusterSpec(64)
    pool = [Deployment.parse(n, cluster) for n in ("1x(tp8,pp2,cp4)", "2x(tp4,pp4,cp2,vp5)")]
    lengths = np.array([5715, 4194, 10598, 5574, 2584, 7584, 23501, 15313, 2112, 1076, 2326, 5164, 301, 3779, 1102,
                        2041, 2557, 3362, 8054, 17171, 4212, 25330, 2212, 7493])
    fused = Planner(seventy, 64, pool, memo={})
    assert fused.plan(lengths).deployment == pool[0]
    own = [Planner(seventy, 64, pool, zero_bubble=True, memo={}).plan_on(lengths, d) for d in pool]
    assert own[1].predicted_time_s < own[0].predicted_time_s
    planned = Planner(seventy, 64, pool, zero_bubble=True, memo={}).plan(lengths)
    assert planned.deployment == pool[1] and planned.predicted_time_s == own[1].predicted_time_s
