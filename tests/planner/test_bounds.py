"""The lower bound (planner/bounds.py): what no plan avoids, below every policy's simulated time."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hydraulis.baselines import make_policy
from hydraulis.cost import load_cost_model
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.bounds import lower_bound
from hydraulis.planner.policy import PolicyContext
from hydraulis.planner.sim import simulate_replica
from hydraulis.specs import ClusterSpec

LONG = load_cost_model("llama-70b@h100-80g+cp")
DEEP = ParallelConfig(2, 4)


def only(config: ParallelConfig):
    """The 7B profile with one config and no fixed cost per micro-batch: the bound's c-free terms are exact."""
    base = load_cost_model("llama-7b@a800-80g")
    k = base.coefficients(config)
    return base.with_configs("one", {config: type(k)(k.a, k.b, 0.0)}, ())


def test_a_lone_sequence_costs_its_whole_trip_on_every_gpu_of_its_replica():
    cost, n = only(DEEP), DEEP.num_gpus
    s = cost.cap(DEEP, n) + 1024  # beyond the cap: its replica runs it alone
    assert s <= cost.lone_cap(DEEP, n)
    w = float(cost.seq_costs(DEEP, np.array([s]))[0])
    assert lower_bound(np.array([s]), cost, n) == pytest.approx(DEEP.pp * w)
    # a shorter one within the cap shares its pipeline: the 1F1B bubble of one micro-batch, (pp - 1) x w, all the same
    w_in = float(cost.seq_costs(DEEP, np.array([s // 2]))[0])
    assert lower_bound(np.array([s // 2]), cost, n) == pytest.approx(DEEP.pp * w_in)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_equal_micro_batches_meet_the_1f1b_bubble_exactly(k):
    """k equal micro-batches on one pp-stage replica take (k + pp - 1) x t in the simulator; so does the bound."""
    cost, n = only(DEEP), DEEP.num_gpus
    s = 1024
    t = float(cost.seq_costs(DEEP, np.array([s]))[0])
    simulated = simulate_replica([t] * k, DEEP.pp, keep_events=False).time_s
    assert simulated == pytest.approx((k + DEEP.pp - 1) * t)
    assert lower_bound(np.full(k, s), cost, n) == pytest.approx(simulated)


POOL = ("1x(tp1,pp16,cp2) + 2x(tp8,pp1,cp2)", "2x(tp4,pp2,cp4)", "4x(tp8,pp2)")


@pytest.mark.parametrize("name", ["hydraulis", "megatron", "flops-balanced", "megatron-dcp", "hotspa"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(long=st.integers(8000, 26000), short=st.lists(st.integers(16, 5000), min_size=1, max_size=40))
def test_no_policy_beats_the_bound_where_pipelines_hold_long_sequences(name, long, short):
    b = np.array([long, *short], dtype=np.int64)
    cluster = ClusterSpec(64)
    ctx = PolicyContext.build(LONG, cluster, [b], [Deployment.parse(t, cluster) for t in POOL])
    policy = make_policy(name, ctx)
    assert lower_bound(b, policy.cost, 64) <= policy.schedule(b).iteration_time_s


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(long=st.integers(8000, 40000), short=st.lists(st.integers(16, 12000), min_size=1, max_size=40))
def test_no_plan_with_memory_policies_beats_the_bound(long, short):
    """Under a policy per micro-batch a sequence beyond a config's cap may run beside others at its policy's cost
    (`ReplicaCost`): the bound prices it so, not as a lone micro-batch pp times over."""
    b = np.array([long, *short], dtype=np.int64)
    cluster = ClusterSpec(64)
    cost = LONG.with_policies(True)
    ctx = PolicyContext.build(cost, cluster, [b], [Deployment.parse(t, cluster) for t in POOL])
    policy = make_policy("hydraulis", ctx)
    assert lower_bound(b, cost, 64) <= policy.schedule(b).iteration_time_s * (1 + 1e-9)


GPU_POLICIES = load_cost_model("llama-7b@a800-80g+cp").with_policies(True)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([9000, 40000, 120000, 200000]),
       st.sampled_from(["2x(tp2,pp4)", "2x(tp2,pp2) + 1x(tp1,pp8)", "8x(tp2,pp1)", "1x(tp2,pp8)"]))
def test_the_bound_on_a_deployments_configs_is_below_its_plans_under_memory_policies(seed, longest, spec):
    """A sequence may run alone under a lighter policy than beside others (selective alone where only full holds
    it beside others): the bound takes the least of both ways, so it stays below the simulated compute of every
    plan (it was up to 1.25x above, pricing 120K tokens on 2x(tp2,pp4) under full)."""
    from hydraulis.planner.planner import Planner
    from hydraulis.planner.sim import simulate

    rng = np.random.default_rng(seed)
    lengths = np.concatenate([np.minimum(rng.lognormal(7.5, 1.0, 60).astype(np.int64) + 32, 12000),
                              rng.integers(13000, 60000, 3), [longest]])
    deployment = Deployment.parse(spec, ClusterSpec(16))
    planner = Planner(GPU_POLICIES, 16, [deployment])
    if not planner.holds(deployment, longest):
        return
    compute = simulate(planner.plan_on(lengths, deployment), GPU_POLICIES, keep_events=False).compute_time_s
    assert lower_bound(lengths, GPU_POLICIES, 16, list(dict.fromkeys(deployment.configs))) <= compute * (1 + 1e-9)


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10_000))
def test_bounds_over_many_deployments_equal_each_bound_alone(seed):
    """`lower_bounds` (the proposal's ranking of phase deployments) computes each config's terms once for all
    the deployments: the same floats as `lower_bound` on each deployment's configs."""
    from hydraulis.planner.bounds import lower_bounds

    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(8.0, 1.2, 40).astype(np.int64) + 16, 30000)
    specs = ["2x(tp2,pp4)", "2x(tp2,pp2) + 1x(tp1,pp8)", "8x(tp2,pp1)", "1x(tp2,pp8)", "4x(tp1,pp2) + 1x(tp2,pp4)"]
    sets = [list(dict.fromkeys(Deployment.parse(s, ClusterSpec(16)).configs)) for s in specs]
    assert lower_bounds(lengths, GPU_POLICIES, 16, sets) == [lower_bound(lengths, GPU_POLICIES, 16, c) for c in sets]
