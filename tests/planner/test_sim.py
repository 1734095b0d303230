from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.parallel import Deployment
from hydraulis.planner.plan import plan_from_assignment
from hydraulis.planner.sim import BACKWARD, FORWARD, closed_form_replica_time, simulate, simulate_replica
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
