"""Fast paths of the per-iteration planner (docs/design.md, "Planning time"), each against its slow definition: the
same plans, less work."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.parallel import Deployment
from hydraulis.planner import phases as phases_module
from hydraulis.planner import planner as planner_module
from hydraulis.planner.dispatch import NoRoom, dispatch
from hydraulis.planner.oracles.zero_bubble import defer_plan
from hydraulis.planner.phases import PhasedPlanner, work_floor
from hydraulis.planner.planner import Planner
from hydraulis.planner.replicas import ReplicaTable
from hydraulis.planner.schedule import phase_compute_s
from hydraulis.planner.sim import simulate, work_bound
from hydraulis.specs import ClusterSpec

CLUSTER = ClusterSpec(64)
POOL = ("1x(tp8,pp2,cp4)", "2x(tp4,pp4,cp2,vp5)", "1x(tp4,pp4,cp4,vp5)", "4x(tp4,pp4)")


@pytest.fixture(scope="module")
def seventy():
    return load_cost_model("llama-70b@h100-80g+cp").with_interleaving().with_policies(True)


def batch(seed: int, n: int = 24) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(8.3, 1.0, n).astype(np.int64) + 64, 30000)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(POOL[1:]))
def test_the_work_bound_is_a_floor_of_every_plan_deferred_or_not(seventy, seed, name):
    """`sim.work_bound`: no plan's simulated iteration is below it, with its weight gradients fused or deferred."""
    deployment = Deployment.parse(name, CLUSTER)
    plan = Planner(seventy, 64, [deployment]).plan_on(batch(seed), deployment)
    deferred = defer_plan(plan, seventy)
    bound = work_bound(plan, seventy)
    assert bound == work_bound(deferred, seventy)  # deferral only reorders the work
    for p in (plan, deferred):
        assert bound <= simulate(p, seventy, keep_events=False).iteration_time_s * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_candidates_that_cannot_win_are_not_deferred_and_the_plan_is_the_same(seventy, seed, monkeypatch):
    """`Planner._deferred` skips a candidate whose work bound is above the fastest deferred plan so far; with the
    bound switched off (0: every candidate within the margin deferred, the slow definition) the plan is the same."""
    pool = [Deployment.parse(n, CLUSTER) for n in POOL]
    lengths = batch(100 + seed, 40)
    calls = []
    finalize = planner_module.finalize
    monkeypatch.setattr(planner_module, "finalize", lambda **kw: calls.append(1) or finalize(**kw))
    fast = Planner(seventy, 64, pool, zero_bubble=True, memo={}).plan(lengths)
    fewer = len(calls)
    monkeypatch.setattr(planner_module, "work_bound", lambda plan, cost: 0.0)
    slow = Planner(seventy, 64, pool, zero_bubble=True, memo={}).plan(lengths)
    assert fewer < len(calls) - fewer
    assert fast.deployment == slow.deployment and fast.replicas == slow.replicas
    assert fast.predicted_time_s == slow.predicted_time_s


def test_a_deferred_plan_is_made_once_per_memo(seventy, monkeypatch):
    """`Planner._finish` with a memo: the same candidate again (another split's phase, a merge) gives the same plan
    without deferring it again."""
    deployment = Deployment.parse(POOL[1], CLUSTER)
    lengths = batch(7)
    calls = []
    finalize = planner_module.finalize
    monkeypatch.setattr(planner_module, "finalize", lambda **kw: calls.append(1) or finalize(**kw))
    planner = Planner(seventy, 64, [deployment], zero_bubble=True, memo={})
    first, again = planner.plan_on(lengths, deployment), planner.plan_on(lengths, deployment)
    assert len(calls) == 1 and first.replicas == again.replicas and first.predicted_time_s == again.predicted_time_s
    alone = Planner(seventy, 64, [deployment], zero_bubble=True).plan_on(lengths, deployment)
    assert alone.replicas == first.replicas and alone.predicted_time_s == first.predicted_time_s


@pytest.mark.parametrize("later", [False, True])
def test_a_phases_compute_is_its_simulation_read_from_the_plan(seventy, later):
    """`schedule.phase_compute_s`: a plan's slowest replica as `finalize` simulated it is the simulator's compute on
    the phases' cost model, for a later phase's plan too (planned within `CostModel.later_phase`'s caps)."""
    deployment = Deployment.parse(POOL[1], CLUSTER)
    cost = seventy.later_phase() if later else seventy
    plan = Planner(cost, 64, [deployment], zero_bubble=True).plan_on(batch(11), deployment)
    assert any(r.deferral for r in plan.replicas)
    assert phase_compute_s(plan, seventy) == simulate(plan, seventy, keep_events=False).compute_time_s
    bare = dataclasses.replace(plan, replica_predicted_s=())  # a plan nobody simulated: simulated here
    assert phase_compute_s(bare, seventy) == phase_compute_s(plan, seventy)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 60), st.sampled_from(POOL))
def test_the_work_floor_is_below_every_dispatch(seventy, seed, n, name):
    """`phases.work_floor`: no dispatch of the batch on the deployment estimates its slowest replica below it."""
    deployment = Deployment.parse(name, CLUSTER)
    table = ReplicaTable.of(seventy, deployment, 64, n)
    lengths = batch(seed, n)
    try:
        found = dispatch(lengths, table, search=False), dispatch(lengths, table)
    except NoRoom:
        return
    assert all(work_floor(table, lengths) <= d.makespan_s * (1 + 1e-12) for d in found)


def test_the_splits_estimates_skip_deployments_that_cannot_be_least(seventy, monkeypatch):
    """`PhasedPlanner.splits`: with each part's deployments dispatched only up to the first whose floor is above the
    least makespan so far, the same splits and estimates as with every one dispatched (floor 0, the slow definition)."""
    pool = [Deployment.parse(n, CLUSTER) for n in POOL]
    lengths = np.concatenate([batch(3, 60), [29000, 30000, 27000]])
    calls = []
    greedy = PhasedPlanner._greedy
    monkeypatch.setattr(PhasedPlanner, "_greedy", lambda self, *a: calls.append(1) or greedy(self, *a))
    fast = PhasedPlanner(seventy, 64, pool, memo={}).splits(lengths)
    fewer = len(calls)
    monkeypatch.setattr(phases_module, "work_floor", lambda table, lengths: 0.0)
    slow = PhasedPlanner(seventy, 64, pool, memo={}).splits(lengths)
    assert fast and fewer < len(calls) - fewer
    assert [(s.estimate_s, [p.tolist() for p in s.phases]) for s in fast] == [
        (s.estimate_s, [p.tolist() for p in s.phases]) for s in slow]
