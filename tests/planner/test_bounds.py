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
    assert lower_bounds(lengths, GPU_POLICIES, 16, sets) == [
        lower_bound(lengths, GPU_POLICIES, 16, c, trips=False) for c in sets]
    # with the trips the scan's sums run in another order of the configs
    with_trips = [lower_bound(lengths, GPU_POLICIES, 16, c) for c in sets]
    assert lower_bounds(lengths, GPU_POLICIES, 16, sets, trips=True) == pytest.approx(with_trips, rel=1e-12)


DEEP_POOLS = {  # 7B on 16 GPUs under memory policies: without CP past 227K only pipelines hold a sequence
    "llama-7b@a800-80g": ("1x(tp2,pp8)", "2x(tp2,pp4)", "2x(tp8,pp1)", "8x(tp2,pp1)", "1x(tp2,pp4) + 4x(tp2,pp1)"),
    "llama-7b@a800-80g+cp": ("1x(tp2,pp8)", "2x(tp2,pp4)", "1x(tp8,pp1,cp2)", "8x(tp2,pp1)", "4x(tp2,pp1,cp2)"),
}


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), profile=st.sampled_from(sorted(DEEP_POOLS)), long=st.integers(100_000, 440_000))
def test_the_trips_bound_stays_below_plans_where_deep_configs_hold_the_longest(seed, profile, long):
    """Long sequences that pipelines hold cheaply but slowly (pp trips of their stage time), or CP or wide replicas
    faster: the bound with the trips in it is at least LB and below the simulated iteration of hydraulis's phased
    plans on a pool of such deployments."""
    rng = np.random.default_rng(seed)
    longest = [long] if profile == "llama-7b@a800-80g" else [long * 3 // 4, *rng.integers(50_000, long * 3 // 4, 2)]
    b = np.concatenate([longest, rng.integers(64, 20_000, 40)]).astype(np.int64)
    cost, cluster = load_cost_model(profile).with_policies(True), ClusterSpec(16)
    ctx = PolicyContext.build(cost, cluster, [b], [Deployment.parse(t, cluster) for t in DEEP_POOLS[profile]])
    simulated = make_policy("hydraulis", ctx).schedule(b).iteration_time_s
    new = lower_bound(b, cost, 16)
    assert lower_bound(b, cost, 16, trips=False) <= new * (1 + 1e-12) and new <= simulated * (1 + 1e-9)


TINY = load_cost_model("llama-7b@a800-80g")


def _best_plan(lengths: np.ndarray) -> float:
    """An exhaustive search on 8 GPUs: every deployment of the replicable configs, each solved by the MILP
    (`exact_assignment`: the closed form sum t + (pp - 1) max t, above both of the bound's terms on every
    replica); inf where none holds the batch within its caps."""
    from hydraulis.planner.milp import exact_assignment
    from hydraulis.planner.pool import place, replicable_configs
    from hydraulis.planner.replicas import ReplicaTable

    cluster = ClusterSpec(8)
    found = (exact_assignment(lengths, ReplicaTable.of(TINY, d, 8), None, time_limit_s=10.0, max_slots=5)
             for d in (place(f, cluster) for f in _multisets(replicable_configs(TINY, cluster), 8)) if d is not None)
    return min((f[1] for f in found if f is not None), default=np.inf)


def _multisets(configs: list[ParallelConfig], gpus: int) -> list[tuple[ParallelConfig, ...]]:
    """Every multiset of `configs` of `gpus` GPUs in all."""
    if gpus == 0:
        return [()]
    return [(g, *rest) for k, g in enumerate(configs) if g.num_gpus <= gpus
            for rest in _multisets(configs[k:], gpus - g.num_gpus)]


@settings(max_examples=4, deadline=None)
@given(long=st.integers(8000, 76_000), short=st.lists(st.integers(64, 6000), min_size=1, max_size=3))
def test_the_trips_bound_is_below_the_best_plan_of_every_deployment(long, short):
    lengths = np.array([long, *short], dtype=np.int64)
    best = _best_plan(lengths)
    new = lower_bound(lengths, TINY, 8)
    assert lower_bound(lengths, TINY, 8, trips=False) <= new * (1 + 1e-12) and new <= best * (1 + 1e-9)


def test_the_trips_bound_is_tighter_where_the_cheapest_config_is_too_slow_for_a_sequence():
    """8 GPUs, 7B without CP: a 26.6K sequence is cheapest on tp4pp1 (1.12 s of the 8 GPUs' time), where it alone
    takes 2.23 s, more than the best plan (1.52 s); LB* runs it on tp8pp1. LB < LB* <= the exhaustive search's best."""
    lengths = np.array([26629, 219, 434, 1371, 1768])
    old, new = lower_bound(lengths, TINY, 8, trips=False), lower_bound(lengths, TINY, 8)
    assert old < 0.95 * new and new <= _best_plan(lengths)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), chunked=st.booleans(), interleave=st.booleans(), policies=st.booleans(),
       spec=st.sampled_from([None, "1x(tp2,pp8)", "2x(tp2,pp2) + 1x(tp1,pp8)", "1x(tp8,pp1,cp2)", "4x(tp2,pp1,cp2)"]))
def test_the_trips_only_raise_the_bound_in_every_variant(seed, chunked, interleave, policies, spec):
    """LB* (the scan over the trips, `_Terms.scan`) >= LB (each sequence's cheapest way whatever its trip): the scan
    ends at every way open, where its sum is LB's, over the job's configs or a deployment's, with chunks,
    interleaved configs or memory policies."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(30_000, 200_000, 2), rng.lognormal(8, 1.2, 50).astype(np.int64) + 16])
    cost = load_cost_model("llama-7b@a800-80g+cp").with_policies(policies)
    configs = None if spec is None else list(dict.fromkeys(Deployment.parse(spec, ClusterSpec(16)).configs))
    lengths = np.minimum(lengths, max(cost.lone_cap(g, 16) for g in configs or cost.configs if g.num_gpus <= 16))
    kw = {"configs": configs, "chunked": chunked, "interleave": interleave}
    assert lower_bound(lengths, cost, 16, trips=False, **kw) <= lower_bound(lengths, cost, 16, **kw) * (1 + 1e-12)
