from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.cost.conditions import SharedCores
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.pipeline_order import BACKWARD, FORWARD, event_graph, one_f_one_b_order
from hydraulis.planner.order_search import replica_time_below
from hydraulis.planner.plan import plan_from_assignment
from hydraulis.planner.sim import (
    FORWARD_SHARE,
    closed_form_replica_time,
    forget,
    shared_timelines,
    simulate,
    simulate_replica,
)
from hydraulis.specs import ClusterSpec


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 5, 16])
def test_identical_micro_batches_give_closed_form(pp, v):
    t = 0.37
    res = simulate_replica([t] * v, pp)
    assert res.time_s == pytest.approx((v + pp - 1) * t, rel=1e-12)


@pytest.mark.parametrize("pp", [1, 2, 4, 8])
def test_one_micro_batch_takes_pp_times_t(pp):
    assert simulate_replica([0.5], pp).time_s == pytest.approx(pp * 0.5)


def test_pp1_is_the_sum():
    t = [0.1, 0.7, 0.3]
    assert simulate_replica(t, 1).time_s == pytest.approx(sum(t))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.01, 5.0), min_size=1, max_size=12),
    st.integers(1, 6),
    st.floats(0.0, 0.05),
)
def test_schedule_is_causal_and_bounded(times, pp, comm):
    res = simulate_replica(times, pp, comm)
    ev = res.events
    assert len(ev) == 2 * pp * len(times)
    end = {(int(s), int(j), int(k)): e for s, j, k, _, e in ev}
    start = {(int(s), int(j), int(k)): b for s, j, k, b, _ in ev}
    for s in range(pp):
        rows = ev[ev[:, 0] == s]
        # A stage runs one thing at a time.
        assert np.all(rows[1:, 3] >= rows[:-1, 4] - 1e-12)
    for (s, j, k), b in start.items():
        if k == FORWARD and s > 0:
            assert b >= end[(s - 1, j, FORWARD)] + comm - 1e-9
        if k == BACKWARD and s < pp - 1:
            assert b >= end[(s + 1, j, BACKWARD)] + comm - 1e-9
        if k == BACKWARD:
            assert b >= end[(s, j, FORWARD)] - 1e-9
    # Never faster than the work of one stage, nor than one micro-batch's trip through all stages.
    assert res.time_s >= sum(times) - 1e-9
    assert res.time_s >= pp * max(times) - 1e-9
    # Never slower than running everything one after another.
    assert res.time_s <= pp * (sum(times) + 2 * len(times) * comm) + 1e-9


def test_unequal_order_matters_and_closed_form_is_not_a_bound():
    # 1F1B with unequal micro-batches: the order decides the stalls, which is why
    # the planner simulates its candidate orders instead of trusting the closed form.
    times = [2.0, 1.0, 2.0, 0.5, 2.0]
    bad = simulate_replica(times, 2).time_s
    good = simulate_replica(sorted(times, reverse=True), 2).time_s
    assert bad > closed_form_replica_time(times, 2)
    assert good < bad


def test_simulate_plan_reports_busy_idle_and_sync():
    cost = load_cost_model("llama-7b@a800-80g")
    cluster = ClusterSpec(8)
    dep = Deployment.parse("1x(tp4,pp1) + 2x(tp1,pp2)", cluster)
    lengths = [30000, 2000, 2000, 1000, 500, 4000, 300]
    plan = plan_from_assignment(0, lengths, dep, [[[0]], [[1, 2], [3, 4]], [[5], [6]]], 0.0)
    res = simulate(plan, cost)
    assert res.replica_times_s[0] == pytest.approx(cost.stage_time(dep.replicas[0].config, [30000]))
    assert res.compute_time_s == pytest.approx(res.replica_times_s.max())
    assert res.iteration_time_s == pytest.approx(res.compute_time_s + cost.grad_sync_time(8))
    assert res.gpu_busy_s.shape == (8,)
    slowest = int(np.argmax(res.replica_times_s))
    for d in dep.replicas[slowest].devices:
        assert res.gpu_idle_s[d] == pytest.approx(0.0, abs=1e-9)
    assert 0.0 < res.bubble_fraction < 1.0


# -- replicas sharing CPU cores (sim.shared_timelines) --------------------------------------------------


def _shared(cores: int, busy: dict) -> SharedCores:
    return SharedCores(cores, 1, busy)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.01, 2.0), min_size=1, max_size=8), st.integers(2, 4), st.floats(0.0, 0.05))
def test_with_a_core_per_rank_the_shared_simulation_is_each_replica_alone(times, pp, comm):
    """Cores enough for every rank: no replica slows another, so each runs as simulate_replica has it."""
    config = ParallelConfig(1, pp)
    shared = _shared(2 * pp, {config: pp})  # measured alone, one core per rank
    timelines = shared_timelines([config, config], [times, times[::-1]], [[comm] * len(times)] * 2, shared)
    for timeline, t in zip(timelines, [times, times[::-1]], strict=True):
        alone = simulate_replica(t, pp, comm)
        assert timeline.time_s == pytest.approx(alone.time_s, rel=1e-9)
        np.testing.assert_allclose(timeline.stage_busy_s, alone.stage_busy_s, rtol=1e-9)
        assert len(timeline.events) == 2 * pp * len(t)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.01, 2.0), min_size=1, max_size=8), st.integers(1, 4))
def test_a_pipeline_that_keeps_the_cores_busy_ends_when_its_work_is_done(times, replicas):
    """Work conservation: without transfers each pp2 replica always has a stage computing, so with as many
    replicas as cores no core idles and the last one ends at the total work / cores. Each stage was
    measured with both stages of one replica computing on the cores (2 busy ranks)."""
    config = ParallelConfig(1, 2)
    shared = _shared(replicas, {config: 2})
    timelines = shared_timelines([config] * replicas, [times] * replicas, [[0.0] * len(times)] * replicas, shared)
    work = replicas * 2 * sum(times) / shared.load(2)  # each task's time at the load it was measured under
    assert max(t.time_s for t in timelines) == pytest.approx(work / replicas, rel=1e-9)


def test_a_waiting_pipeline_stage_lends_its_core():
    """Two pp2 replicas on two cores: scaled by all four ranks they would take (v + 1) t x 2; in 1F1B each
    stage waits for t of that (warm-up or cool-down), and the other replica's stages use the core meanwhile:
    8 t for 4 micro-batches, as the 2x(tp1,pp2) check measured (0.28 s against 8 t = 0.29 s)."""
    config = ParallelConfig(1, 2)
    shared = _shared(2, {config: 2})  # one replica measured alone: its two ranks on the two cores
    timelines = shared_timelines([config, config], [[1.0] * 4] * 2, [[0.0] * 4] * 2, shared)
    assert [t.time_s for t in timelines] == pytest.approx([8.0, 8.0])
    assert (4 + 1) * 2 > 8.0  # what scaling each replica by the deployment's busy ranks predicted


def recurrence_1f1b(times: list[float], pp: int, comm: list[float]) -> dict[tuple[int, int, int], float]:
    """Each event's end from its definition, by recursion: it starts once its stage has run the event before
    it (1F1B order) and its input has arrived; the simulator's one pass must agree to the last bit."""
    orders = [one_f_one_b_order(pp, len(times), s) for s in range(pp)]
    memo: dict[tuple[int, int, int], float] = {}

    def end(s: int, kind: int, j: int) -> float:
        if (s, kind, j) not in memo:
            k = orders[s].index((kind, j))
            start = end(s, *orders[s][k - 1]) if k else 0.0
            if kind == FORWARD and s > 0:
                start = max(start, end(s - 1, FORWARD, j) + comm[j])
            elif kind == BACKWARD:
                start = max(start, end(s, FORWARD, j) if s == pp - 1 else end(s + 1, BACKWARD, j) + comm[j])
            share = FORWARD_SHARE if kind == FORWARD else 1.0 - FORWARD_SHARE
            memo[(s, kind, j)] = start + float(np.float64(times[j]) * share)
        return memo[(s, kind, j)]

    return {(s, kind, j): end(s, kind, j) for s in range(pp) for kind, j in orders[s]}


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(1e-4, 50.0), min_size=1, max_size=14), st.integers(2, 9), st.floats(0.0, 0.5))
def test_the_one_pass_1f1b_is_its_recurrence(times, pp, comm_scale):
    comm = [comm_scale * (1 + (j % 3)) for j in range(len(times))]
    want = recurrence_1f1b(times, pp, comm)
    res = simulate_replica(times, pp, comm)
    got = {(int(s), int(k), int(j)): e for s, j, k, _, e in res.events}
    assert got == want
    assert res.time_s == max(want.values())
    assert simulate_replica(times, pp, comm, keep_events=False).time_s == res.time_s


def event_loop(times: np.ndarray, pp: int, vp: int, comm: np.ndarray) -> list[float]:
    """Each event's end, event by event in `event_graph`'s order, its duration and transfer written out per event
    (the simulator's loop before its tables): after its stage's previous event and its input plus the transfer
    where the input ran on another stage."""
    g = event_graph(pp, vp, len(times))
    end: list[float] = []
    for s, kind, j, p, d in zip(g.stage, g.kind, g.micro_batch, g.prev, g.dep, strict=True):
        share = FORWARD_SHARE if kind == FORWARD else 1.0 - FORWARD_SHARE
        ready = 0.0 if d < 0 else end[d] + (float(comm[j]) if g.stage[d] != s else 0.0)
        end.append(max(end[p] if p >= 0 else 0.0, ready) + float(times[j] * share / vp))
    return end


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(1e-3, 30.0), min_size=1, max_size=20), st.sampled_from([2, 4, 8, 16]),
       st.sampled_from([1, 2, 5]), st.floats(0.0, 0.3), st.floats(0.97, 1.03))
def test_the_simulation_and_the_search_give_the_plain_event_loop(times, pp, vp, comm_scale, ratio):
    """Variable-length micro-batches on deep pipelines: the simulator's table-indexed loop gives every event's end
    of the plain loop, to the bit, and the order search's bounded simulation its time, or inf only above its beat."""
    t = np.array(times)
    comm = comm_scale * (1 + np.arange(len(t)) % 3)
    want = event_loop(t, pp, vp, comm)
    res = simulate_replica(t, pp, comm, vp=vp)
    assert res.events[:, 4].tolist() == want
    assert res.time_s == max(want)
    forget()
    beat = max(want) * ratio
    got = replica_time_below(t, pp, comm, vp, beat)
    assert got == max(want) if max(want) <= beat else got in (np.inf, max(want))
