"""Interleaved 1F1B (vp model chunks per pipeline rank): its order, its timeline and the memory it holds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.cost.activations import COUNT_HORIZON, counted, in_flight, worst_count
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.pipeline_order import (
    BACKWARD,
    FORWARD,
    depends_on,
    event_graph,
    interleave_group,
    interleaved_order,
    one_f_one_b_order,
    stage_order,
    stage_tables,
)
from hydraulis.planner.bounds import lower_bound
from hydraulis.planner.dispatch import _scalar_estimate
from hydraulis.planner.packing import pack_replica
from hydraulis.planner.plan import plan_from_assignment
from hydraulis.planner.planner import assemble
from hydraulis.planner.replicas import ReplicaCost, ReplicaTable, estimate_time
from hydraulis.planner.sim import FORWARD_SHARE, simulate, simulate_replica
from hydraulis.specs import ClusterSpec, get_model


def recurrence(times: list[float], pp: int, vp: int, comm: list[float]) -> dict[tuple[int, int, int, int], float]:
    """Each event's end from its definition: after the event before it on its stage, and after its input. Virtual
    stage k = chunk * pp + stage runs layers k / (pp vp) onwards: a forward needs virtual stage k - 1's forward
    (on rank k - 1 mod pp), a backward k + 1's backward, the very last one its own forward; each transfer
    between ranks costs the micro-batch's p2p time."""
    orders = [interleaved_order(pp, vp, len(times), s) for s in range(pp)]
    position = [{e: k for k, e in enumerate(order)} for order in orders]
    memo: dict[tuple[int, int, int, int], float] = {}
    last = pp * vp - 1

    def end(s: int, kind: int, j: int, c: int) -> float:
        key = (s, kind, j, c)
        if key not in memo:
            k = position[s][(kind, j, c)]
            start = end(s, *orders[s][k - 1]) if k else 0.0
            virtual = c * pp + s
            if kind == FORWARD and virtual > 0:
                before = virtual - 1
                start = max(start, end(before % pp, FORWARD, j, before // pp) + comm[j])
            elif kind == BACKWARD and virtual == last:
                start = max(start, end(s, FORWARD, j, c))
            elif kind == BACKWARD:
                after = virtual + 1
                start = max(start, end(after % pp, BACKWARD, j, after // pp) + comm[j])
            share = FORWARD_SHARE if kind == FORWARD else 1.0 - FORWARD_SHARE
            memo[key] = start + float(np.float64(times[j]) * share / vp)
        return memo[key]

    return {(s, kind, j, c): end(s, kind, j, c) for s in range(pp) for kind, j, c in orders[s]}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(1e-3, 20.0), min_size=1, max_size=12), st.integers(2, 6), st.integers(2, 4),
       st.floats(0.0, 0.3))
def test_the_simulation_is_its_recurrence(times, pp, vp, comm_scale):
    comm = [comm_scale * (1 + j % 3) for j in range(len(times))]
    want = recurrence(times, pp, vp, comm)
    res = simulate_replica(times, pp, comm, vp=vp)
    got = {(int(s), int(k), int(j), int(c)): e for (s, j, k, _, e), c in zip(res.events, res.chunks, strict=True)}
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert res.time_s == pytest.approx(max(want.values()), rel=1e-12)
    assert simulate_replica(times, pp, comm, keep_events=False, vp=vp).time_s == res.time_s


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(1e-3, 20.0), min_size=1, max_size=12), st.integers(1, 8), st.floats(0.0, 0.3))
def test_vp1_is_the_plain_1f1b(times, pp, comm):
    """vp = 1 is today's simulator to the bit: the same order, each event's end the same float."""
    for s in range(pp):
        assert interleaved_order(pp, 1, len(times), s) == [(k, j, 0) for k, j in one_f_one_b_order(pp, len(times), s)]
    plain, interleaved = simulate_replica(times, pp, comm), simulate_replica(times, pp, comm, vp=1)
    assert plain.time_s == interleaved.time_s
    np.testing.assert_array_equal(plain.events, interleaved.events)
    assert interleaved.chunks is None


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("vp", [2, 3, 5])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_equal_micro_batches_leave_the_closed_form_bubble(pp, vp, groups):
    """m = groups x pp equal micro-batches, free transfers: the bubble is (pp - 1) / (vp m) of the work."""
    m, t = groups * pp, 0.37
    res = simulate_replica([t] * m, pp, vp=vp)
    assert res.time_s / (m * t) - 1 == pytest.approx((pp - 1) / (vp * m), rel=1e-9)


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("vp", [2, 3, 4, 5])
def test_every_micro_batch_count_runs_and_each_event_once(pp, vp):
    """Megatron's group rule (`interleave_group`) leaves no count that deadlocks; every (micro-batch, chunk) runs
    its forward and its backward once on each stage."""
    for m in range(1, 4 * pp + 3):
        res = simulate_replica(np.linspace(1.0, 2.0, m), pp, 0.01, vp=vp)
        keys = {(int(s), int(j), int(k), int(c)) for (s, j, k, _, _), c in zip(res.events, res.chunks, strict=True)}
        assert len(keys) == len(res.events) == 2 * pp * vp * m
        group = interleave_group(pp, m)
        assert group == m if m <= pp else (pp <= group <= m and (m % group == 0 or m % group >= pp))


def swept(pp: int, vp: int, m: int) -> list[tuple[int, int, int, int]]:
    """The stages swept in turn, each through its `stage_order` as far as its inputs have run, until all have:
    (stage, kind, micro-batch, chunk) in the order the events become computable."""
    orders = [stage_order(pp, vp, m, s) for s in range(pp)]
    ptr, done, out = [0] * pp, set(), []
    while len(out) < 2 * pp * vp * m:
        for s in range(pp):
            while ptr[s] < len(orders[s]):
                kind, j, c = orders[s][ptr[s]]
                on = depends_on(pp, vp, s, kind, c)
                if on is not None and (*on, j) not in done:
                    break
                done.add((s, kind, c, j))
                out.append((s, kind, j, c))
                ptr[s] += 1
    return out


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 3, 4, 8, 16]), st.sampled_from([1, 2, 3, 5, 10]), st.integers(0, 40))
def test_the_event_graph_is_the_stages_swept_in_turn(pp, vp, m):
    """`event_graph` (built on integer tables) lists the events as a plain sweep finds them, each stage's in its
    `stage_order` (`stage_tables` row by row), its stage's previous event and its input (`depends_on`) by index."""
    kind, mb, chunk = stage_tables(pp, vp, m) if m else (np.zeros((pp, 0)),) * 3
    for s in range(pp):
        assert list(zip(kind[s].tolist(), mb[s].tolist(), chunk[s].tolist(), strict=True)) == list(
            stage_order(pp, vp, m, s))
    g = event_graph(pp, vp, m)
    events = list(zip(g.stage, g.kind, g.micro_batch, g.chunk, strict=True))
    assert events == swept(pp, vp, m)
    index, last = {(s, k, c, j): e for e, (s, k, j, c) in enumerate(events)}, [-1] * pp
    for e, (s, k, j, c) in enumerate(events):
        assert g.prev[e] == last[s]
        last[s] = e
        on = depends_on(pp, vp, s, k, c)
        assert g.dep[e] == (-1 if on is None else index[(*on, j)])
    assert list(g.last) == last


def held_by_order(pp: int, vp: int, m: int, stage: int) -> int:
    """Most chunks whose activations the stage holds at once: forwards run less backwards run, at their peak."""
    held = peak = 0
    for kind, _, _ in interleaved_order(pp, vp, m, stage):
        held += 1 if kind == FORWARD else -1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("vp", [1, 2, 5])
def test_the_memory_model_holds_what_the_order_holds(pp, vp):
    config = ParallelConfig(1, pp, 1, vp)
    for m in range(1, 4 * pp + 2):
        for s in range(pp):
            assert in_flight(config, s, m) == held_by_order(pp, vp, m, s)


@pytest.mark.parametrize("pp", [3, 4, 8])
@pytest.mark.parametrize("vp", [2, 4, 5])
def test_the_count_a_cap_is_for_holds_what_the_order_holds_at_every_count(pp, vp):
    """Walking each stage's order (`stage_order`) for every count to 12 pp: the count its cap is for (`counted`;
    None: the cap for any count's, `worst_counts`) holds, as the memory model counts it, at least the chunks the
    order holds at once, and so does the worst count. Megatron's group has no period (1 + lcm(pp, ..., 2pp - 1)
    micro-batches need a group of at least 2 pp, beyond every smaller count's), so every interleaved count is
    held at its own; to the horizon the worst count holds the most by the model's count."""
    config = ParallelConfig(1, pp, 1, vp)
    for s in range(pp):
        worst = in_flight(config, s, worst_count(config, s))
        for m in range(2, 12 * pp + 1):
            held = held_by_order(pp, vp, m, s)
            used = counted(config, m)
            assert in_flight(config, s, worst_count(config, s) if used is None else used) >= held, (s, m)
            assert worst >= held, (s, m)
        assert all(worst >= in_flight(config, s, m) for m in range(2, COUNT_HORIZON + 1))
    far = 1 + int(np.lcm.reduce(np.arange(pp, 2 * pp)))
    assert interleave_group(pp, far) >= 2 * pp > max(interleave_group(pp, m) for m in range(2, 4 * pp))
    assert in_flight(config, 0, far) > max(in_flight(config, 0, m) for m in range(2, 4 * pp + 1))
    assert counted(config, far) == far


def test_the_warm_up_counted_by_hand():
    """pp 4, vp 2, 8 micro-batches: stage 0 warms up with 2 x 3 + 1 x 4 = 10 chunk forwards and holds 11 chunks of
    L/8 layers at once (1F1B: 4 micro-batches of L/4); the last stage 0 + 4 + 1 = 5 (1F1B: 1)."""
    assert in_flight(ParallelConfig(1, 4, 1, 2), 0, 8) == 11
    assert in_flight(ParallelConfig(1, 4, 1, 2), 3, 8) == 5
    assert in_flight(ParallelConfig(1, 4), 0, 8) == 4
    # A lone micro-batch: all vp chunks, one stage's layers, as under 1F1B.
    assert in_flight(ParallelConfig(1, 4, 1, 2), 0, 1) == 2


def test_interleaving_costs_memory_and_keeps_the_lone_cap():
    """More layers in flight: a smaller cap beside others; a lone micro-batch holds one stage's layers either way."""
    cost = load_cost_model("llama-70b@h100-80g+cp")
    plain, interleaved = ParallelConfig(4, 8), ParallelConfig(4, 8, 1, 5)
    assert cost.cap(interleaved, 64) < cost.cap(plain, 64)
    assert cost.lone_cap(interleaved, 64) == cost.lone_cap(plain, 64)
    assert cost.stage_time(interleaved, [4096]) == cost.stage_time(plain, [4096])


def test_an_interleaved_plan_beats_1f1b_and_stays_above_its_bound():
    cost = load_cost_model("llama-7b@a800-80g")
    cluster = ClusterSpec(8)
    lengths = [4096] * 8 + [2048] * 8
    times = {}
    for text in ("1x(tp1,pp8)", "1x(tp1,pp8,vp2)"):
        dep = Deployment.parse(text, cluster)
        plan = plan_from_assignment(0, lengths, dep, [[[i] for i in range(16)]], 0.0)
        res = simulate(plan, cost)
        times[text] = res.compute_time_s
        assert res.iteration_time_s >= lower_bound(np.array(lengths), cost, 8, dep.configs) - 1e-12
    assert times["1x(tp1,pp8,vp2)"] < times["1x(tp1,pp8)"]


def test_configs_name_parse_and_validate_vp():
    config = ParallelConfig.parse("(tp4,pp8,vp5)")
    assert config == ParallelConfig(4, 8, 1, 5) and config.name == "tp4pp8vp5" and config.base == ParallelConfig(4, 8)
    assert ParallelConfig.parse("tp1pp4cp2vp2").compact() == "(tp1,pp4,cp2,vp2)"
    assert ParallelConfig(2, 4).row() == {"tp": 2, "pp": 4, "cp": 1}
    model = get_model("llama-70b")
    assert ParallelConfig(4, 8).vp_choices(model) == (5, 2)  # Megatron-LM's Llama-3 70B recipe: TP4 PP8 VP5
    assert ParallelConfig(4, 4).vp_choices(model) == (5, 4, 2)  # Megatron-Bridge's: PP4 VP5
    assert ParallelConfig(1, 2).vp_choices(model) == ()
    # Hydraulis's own: one layer a chunk (pp 16 has stages of 5 layers, which no recipe's chunks split).
    assert [ParallelConfig(4, pp).planned_vp_choices(model) for pp in (2, 4, 8, 16)] == [(), (20,), (10,), (5,)]
    ParallelConfig(4, 8, 1, 10).validate(model)
    with pytest.raises(HydraulisError, match="vp"):
        ParallelConfig(4, 8, 1, 3).validate(model)
    with pytest.raises(HydraulisError, match="needs a pipeline"):
        ParallelConfig(1, 1, 1, 2)


def test_an_interleaved_plan_round_trips_its_vp_and_plain_rows_stay_as_they_were():
    cluster = ClusterSpec(16)
    dep = Deployment.parse("1x(tp1,pp8,vp2) + 2x(tp2,pp2)", cluster)
    plan = plan_from_assignment(0, [4096, 2048, 1024], dep, [[[0], [1]], [[2]], []], 0.0)
    data = plan.to_dict()
    assert [row.get("vp") for row in data["deployment"]] == [2, None, None]
    back = type(plan).from_dict(data, cluster, "plan")
    assert back.deployment.configs == dep.configs and str(back.deployment) == "1x(tp1,pp8,vp2) + 2x(tp2,pp2)"


def test_with_interleaving_offers_chunks_of_one_layer_at_the_same_coefficients():
    cost = load_cost_model("llama-70b@h100-80g+cp")
    wide = cost.with_interleaving()
    extra = set(wide.configs) - set(cost.configs)
    assert extra and all(g.base in cost.configs and g.vp == cost.model.layers // g.pp for g in extra)
    assert ParallelConfig(4, 8, 1, 10) in extra and not any(g.pp <= 2 for g in extra)
    g = ParallelConfig(4, 8, 1, 10)
    assert wide.coefficients(g) == cost.coefficients(g.base) and wide.name == f"{cost.name}+vp"


@pytest.mark.parametrize(("pp", "vp"), [(8, 5), (8, 2), (4, 2)])
def test_the_estimate_of_fewer_micro_batches_than_stages_is_the_simulated_time(pp, vp):
    """Interleaved, v < pp equal micro-batches wait for their chunks to come round: the simulation's
    pp t + (v - 1) t / vp, which the dispatch's estimate (`wrap`) and its scalar form give; 1F1B's (v + pp - 1) t
    needs no wrap."""
    t = 0.5
    for v in range(1, 2 * pp + 1):
        sums = {"W": v * t, "T": v * 1000, "n": v, "wmax": t, "c": 0.0, "cap": 1000, "min_efficient": 0}
        for wrap, config_vp in ((pp, vp), (0, 1)):
            simulated = simulate_replica([t] * v, pp, keep_events=False, vp=config_vp).time_s
            if v > pp and v % pp and config_vp > 1:
                continue  # a count whose last group is short: the closed form is a floor there
            est = float(estimate_time(**sums, pp=1 + (pp - 1) / config_vp, wrap=wrap))
            assert est == pytest.approx(simulated, rel=1e-9), (v, config_vp)
            scalar = _scalar_estimate(v * t, v * 1000, v, t, (0.0, (pp - 1) / config_vp, 1000, 0, None, None, wrap))
            assert scalar == pytest.approx(est, rel=1e-12)
    # A sequence past the cap runs as the replica's lone micro-batch: pp trips, interleaved too.
    lone = {"W": t, "T": 5000, "n": 1, "wmax": t, "c": 0.0, "cap": 1000, "min_efficient": 0, "lone_cap": 8000,
            "long_w": t / 2}
    est = float(estimate_time(**lone, pp=1 + (pp - 1) / vp, wrap=pp))
    assert est == pytest.approx(simulate_replica([t], pp, keep_events=False, vp=vp).time_s, rel=1e-9)
    assert _scalar_estimate(t, 5000, 1, t, (0.0, (pp - 1) / vp, 1000, 0, 8000, t / 2, pp)) == est


def test_an_interleaved_replica_bound_by_its_cap_packs_to_a_count_whose_group_is_pp():
    """Where the any-count cap sets the count, counts whose group is pp hold more per micro-batch: the packing
    takes one at its cap, with fewer micro-batches (less fixed cost) than the any-count cap allows, faster as
    simulated, and the plan holds at its own count."""
    cost = load_cost_model("llama-70b@h100-80g+cp").with_interleaving().with_policies(True)
    deployment = Deployment.parse("1x(tp1,pp8,cp8,vp5)", ClusterSpec(64))
    replica = ReplicaCost.of(cost, deployment.configs[0], 64)
    lengths = np.full(200, replica.cap // 3)
    assert replica.cap_at(16) > replica.cap
    grouped = pack_replica(np.arange(200), lengths, replica, cost)
    plain = pack_replica(np.arange(200), lengths, dataclasses.replace(replica, count_cap=None), cost)
    count = len(grouped.micro_batches)
    assert count % 8 == 0 and count < len(plain.micro_batches) and grouped.time_s < plain.time_s
    plan = assemble(0, lengths, deployment, [grouped.micro_batches], ReplicaTable.of(cost, deployment, 64))
    plan.validate(cost, 64)
