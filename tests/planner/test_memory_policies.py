"""Memory policies per micro-batch in the planner: caps per policy, the lightest that holds each micro-batch,
their times in the simulator, and the plan's JSON and wire forms carrying them."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.cost.activations import COUNT_HORIZON, worst_count
from hydraulis.cost.memory import DEFAULT_EXCHANGE_BUCKET_BYTES, rank_memory
from hydraulis.cost.policies import LIGHTEST_FIRST, MemoryPolicy
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment
from hydraulis.parallel import ParallelConfig as P
from hydraulis.pipeline_order import interleave_group
from hydraulis.planner.dispatch import NoRoom, dispatch
from hydraulis.planner.packing import stage_times
from hydraulis.planner.plan import PlanFile, Schedule, decode_plan, encode_plan, load_plan, save_plan
from hydraulis.planner.planner import Planner, assemble
from hydraulis.planner.replicas import ReplicaCost, ReplicaTable
from hydraulis.specs import ClusterSpec

TIGHT = load_cost_model("tiny@cpu-measured").for_job(28 << 20, 4)  # fp32, 28 MiB per rank
POLICIES = TIGHT.with_policies(True)
POOL = [Deployment.parse(t, ClusterSpec(4)) for t in ("4x(tp1,pp1)", "2x(tp2,pp1)", "2x(tp1,pp2)")]


def test_each_policy_holds_more_and_the_lone_cap_is_the_heaviest():
    for g in (P(1, 1), P(1, 2), P(2, 1)):
        caps = [POLICIES.policy_cap(g, 4, p) for p in LIGHTEST_FIRST]
        assert caps[0] == TIGHT.cap(g, 4) == POLICIES.cap(g, 4) and caps[0] < caps[1] < caps[2]
        assert POLICIES.lone_cap(g, 4) == POLICIES.policy_cap(g, 4, MemoryPolicy.FULL, 1) > TIGHT.lone_cap(g, 4)
    assert TIGHT.policies(P(1, 1)) == (MemoryPolicy.NONE,)
    assert POLICIES.with_recompute([P(1, 1)]).policies(P(1, 1)) == (MemoryPolicy.FULL,)


def test_a_micro_batch_over_the_plain_cap_recomputes_on_the_cheaper_replica():
    """Over tp1's plain cap (1,152 tokens at 28 MiB), within selective's: without policies only a wide or deep
    deployment holds the batch; with them every replica is tp1 and that micro-batch alone recomputes."""
    lengths = np.array([1800, 900, 800, 700, 700, 600, 500, 400, 300, 200])
    off = Planner(TIGHT, 4, POOL[:2]).plan(lengths)
    on = Planner(POLICIES, 4, POOL[:2]).plan(lengths)
    assert str(off.deployment) != "4x(tp1,pp1)" and str(on.deployment) == "4x(tp1,pp1)"
    assert on.predicted_time_s < off.predicted_time_s
    chosen = {on.policy(r, k) for r, rp in enumerate(on.replicas) for k in range(len(rp.micro_batches))}
    assert MemoryPolicy.SELECTIVE in chosen and MemoryPolicy.FULL not in chosen


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(16, POLICIES.lone_cap(P(1, 2), 4)), min_size=1, max_size=24), st.integers(0, 2))
def test_every_micro_batch_runs_the_lightest_policy_that_holds_it(lengths, which):
    """Within its policy's cap (a lone one: its lone cap), no lighter policy's cap holding it, within the budget
    by rank_memory under that policy, and timed by the simulator under it."""
    lengths = np.array(lengths)
    planner = Planner(POLICIES, 4, POOL)
    deployment = POOL[which]
    if not planner.holds(deployment, int(lengths.max())):
        return
    try:
        plan = planner.plan_on(lengths, deployment)
    except NoRoom:  # more sequences beyond the caps than lone micro-batches to hold them
        return
    for r, (replica, config) in enumerate(zip(plan.replicas, deployment.configs, strict=True)):
        count = len(replica.micro_batches)
        for k, mb in enumerate(replica.micro_batches):
            tokens = int(lengths[list(mb)].sum())
            policy = plan.policy(r, k) or MemoryPolicy.NONE
            lone = 1 if count == 1 else None
            assert tokens <= POLICIES.policy_cap(config, 4, policy, lone)
            lighter = LIGHTEST_FIRST[: LIGHTEST_FIRST.index(policy)]
            assert all(tokens > POLICIES.policy_cap(config, 4, p, lone) for p in lighter)
            if count == 1 or config.pp == 1:
                for stage in range(config.pp):
                    rank = rank_memory(POLICIES.memory, POLICIES.model, config, stage, 4, tokens, 4,
                                       DEFAULT_EXCHANGE_BUCKET_BYTES, policy, count)
                    assert rank.peak <= POLICIES.memory.usable_bytes


def test_plans_carry_their_policies_in_json_and_on_the_wire(tmp_path):
    lengths = np.array([1800, 900, 800, 700, 700, 600, 500, 400, 300, 200])
    plan = Planner(POLICIES, 4, POOL[:2]).plan(lengths, 3)
    assert any(r.policies for r in plan.replicas)
    assert decode_plan(encode_plan(plan, 0), 3, plan.lengths, [plan.deployment]) == plan
    path = tmp_path / "plan.json"
    save_plan(path, PlanFile(POLICIES.name, 4, (Schedule.single(plan),)))
    assert load_plan(path).iterations[0].phases[0] == plan
    assert "selective" in json.dumps(json.loads(path.read_text())["iterations"][0]["replicas"])
    plan.validate(POLICIES, 4)
    plain = Planner(TIGHT, 4, POOL[1:]).plan(lengths)
    assert not any(r.policies for r in plain.replicas)
    assert decode_plan(encode_plan(plain, 0), 0, plain.lengths, [plain.deployment]) == plain


def test_a_policy_measured_slower_than_a_heavier_one_is_never_chosen():
    """A profile may time selective slower than full (one point, a loaded machine): full then runs whatever
    selective would hold, the cheaper of the two."""
    cost = POLICIES.with_policies(True)
    cost.policy_scales = {P(1, 1): {MemoryPolicy.SELECTIVE: (1.6, 1.6), MemoryPolicy.FULL: (1.5, 1.5)}}
    lengths = np.array([1800, 900, 800, 700, 700, 600, 500, 400, 300, 200])
    plan = Planner(cost, 4, POOL[:1]).plan(lengths)
    chosen = {plan.policy(r, k) for r, rp in enumerate(plan.replicas) for k in range(len(rp.micro_batches))}
    assert MemoryPolicy.FULL in chosen and MemoryPolicy.SELECTIVE not in chosen


LONG70 = load_cost_model("llama-70b@h100-80g+cp").with_policies(True)


def test_a_sequence_beyond_every_policys_cap_beside_others_counts_as_lone():
    """The estimate knows a lone micro-batch by its cost (`ReplicaCost.long_w`); a lighter policy alone may cost
    less just beyond `reach` than a heavier one beside others at it (tp1pp8: selective alone, full beside), and
    every longer sequence must still read as lone, or dispatch packs it beside others (found by the bench)."""
    from hydraulis.planner.replicas import ReplicaCost

    cheaper_beyond = 0
    for config in (g for g in LONG70.configs if g.num_gpus <= 64):
        r = ReplicaCost.of(LONG70, config, 64)
        s = np.arange(r.reach + 1, r.holds + 1, 97)
        assert (r.seq_costs(s) > r.long_w).all()
        cheaper_beyond += bool((r.seq_costs(s) <= r.seq_costs(np.array([r.reach]))[0]).any())
    assert cheaper_beyond  # the case exists on this profile


def test_a_uniform_policy_runs_every_micro_batch_of_its_configs():
    """A baseline's run-wide setting (`with_uniform`): selective's caps are the config's plain ones, its times
    the derived factors' on every micro-batch; full is the recompute set."""
    from hydraulis.cost.policies import derived_scales

    g, other = P(1, 1), P(1, 2)
    cost = TIGHT.with_uniform([g], MemoryPolicy.SELECTIVE)
    assert cost.policies(g) == (MemoryPolicy.SELECTIVE,) and cost.policies(other) == (MemoryPolicy.NONE,)
    assert cost.cap(g, 4) == TIGHT.policy_cap(g, 4, MemoryPolicy.SELECTIVE) > TIGHT.cap(g, 4)
    sa, sb = derived_scales(TIGHT.model)[MemoryPolicy.SELECTIVE]
    k, u = TIGHT.coefficients(g), cost.coefficients(g)
    assert (u.a, u.b, u.c) == (k.a * sa, k.b * sb, k.c) and cost.coefficients(other) == TIGHT.coefficients(other)
    assert cost.stage_time(g, [700]) == TIGHT.stage_time(g, [700], MemoryPolicy.SELECTIVE)
    assert TIGHT.with_uniform([g], MemoryPolicy.FULL).recompute == {g}
    assert TIGHT.with_uniform([g], MemoryPolicy.NONE) is TIGHT


def test_the_range_programme_packs_a_length_a_policy_holds_beside_others():
    """Beyond tp1's plain cap, within selective's: without policies a replica runs each such sequence as its lone
    micro-batch, so two per replica never fit; with them they run beside each other at selective's cost."""
    from hydraulis.planner.proposal.range_dp import LengthHistogram, aware_group_time

    g = P(1, 1)
    s = TIGHT.cap(g, 4) + 200
    assert s <= POLICIES.policy_cap(g, 4, MemoryPolicy.SELECTIVE) and 2 * s > TIGHT.lone_cap(g, 4)
    hist = LengthHistogram(np.array([s]), np.array([8.0]))
    off = aware_group_time(TIGHT, [g], hist, 4)(0, np.array([0, 1]), np.array([4.0]))
    on = aware_group_time(POLICIES, [g], hist, 4)(0, np.array([0, 1]), np.array([4.0]))
    assert np.isinf(off).all() and np.isfinite(on).all()
    w, c = TIGHT.stage_time(g, [s], MemoryPolicy.SELECTIVE), TIGHT.coefficients(g).c
    assert 2 * w <= on[0] <= 2 * w + c  # two micro-batches of one sequence each, pp = 1 (c per cap's worth of tokens)


GPU = load_cost_model("llama-7b@a800-80g+cp").with_policies(True)  # timed on GPUs: no shared cores
GPU_VP = GPU.with_interleaving()
GPU_POOL = [Deployment.parse(t, ClusterSpec(16)) for t in ("4x(tp1,pp4)", "2x(tp2,pp4)", "2x(tp2,pp2) + 1x(tp1,pp8)")]


def mixed_batch(seed: int, longest: int) -> np.ndarray:
    """Short documents, a few beyond the plain caps (within selective's or full's), and one of `longest`."""
    rng = np.random.default_rng(seed)
    short = np.minimum(rng.lognormal(7.5, 1.0, 60).astype(np.int64) + 32, 12000)
    return np.concatenate([short, rng.integers(13000, 60000, 3), [longest]])


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([9000, 40000, 120000, 200000]))
def test_the_bound_that_skips_packing_is_below_every_plan_and_changes_no_plan(seed, longest):
    """`Planner.plan` skips packing a deployment whose lower bound (`ReplicaTable.compute_bound` plus the step)
    is above the best simulated plan so far. The bound is below the simulated compute of the plans the planner
    makes on each deployment, lone micro-batches and recompute included, and skipping changes no plan."""
    lengths = mixed_batch(seed, longest)
    planner = Planner(GPU, 16, GPU_POOL)
    for k, d in enumerate(GPU_POOL):
        if planner.holds(d, longest):
            plan = planner.plan_on(lengths, d)
            bound = planner._tables_for(lengths)[k].compute_bound(lengths)
            assert bound <= plan.predicted_time_s - GPU.step_time(d.configs) + 1e-9
    unbounded = Planner(GPU, 16, GPU_POOL)
    unbounded._bound = lambda lengths, k: 0.0  # type: ignore[method-assign]
    ours, every = planner.plan(lengths), unbounded.plan(lengths)
    assert ours.deployment == every.deployment and ours.replicas == every.replicas
    assert ours.predicted_time_s == every.predicted_time_s
    # The outlook counts a skipped deployment at its bound (at least that slow), a packed one at its plan's time.
    planner.remember(0)
    assert min(planner.outlook[0]) == 1.0 and len(planner.outlook[0]) == len(GPU_POOL)
    for k, d in enumerate(GPU_POOL):
        if planner.holds(d, longest):
            assert planner.outlook[0][k] * ours.predicted_time_s >= planner._bound(lengths, k) * (1 - 1e-12)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(1, 4), (2, 4), (1, 8), (2, 2, 2), (1, 4, 1, 2), (1, 8, 1, 2)]),
       st.integers(1, 12))
def test_stage_times_in_one_pass_are_the_cost_models_one_by_one(seed, config, count):
    """`packing.stage_times` (what ordering by simulation reads) equals `CostModel.stage_time` per micro-batch
    under its policy to the last bit, lone micro-batches, those beyond the plain cap and, interleaved, those
    beyond it within their count's cap (`ReplicaCost.cap_at`) included."""
    rng = np.random.default_rng(seed)
    cost = GPU_VP if len(config) > 3 else GPU
    replica = ReplicaCost.of(cost, P(*config), 16)
    lengths = rng.integers(1, replica.reach if count > 1 else replica.holds, 4 * count)
    micro_batches = np.array_split(rng.permutation(len(lengths))[: 2 * count], count)
    if seed % 3 == 0:  # an empty micro-batch first, in the middle and last: it sums to 0 tokens
        micro_batches = [micro_batches[0][:0], *micro_batches, micro_batches[0][:0]]
    if seed % 5 == 0:  # a micro-batch past EXACT_SQUARES tokens: the one-by-one path, the same figures
        lengths = np.r_[lengths, 1 << 26]
        micro_batches = [*micro_batches, np.array([len(lengths) - 1])]
    tokens, times = stage_times(micro_batches, lengths, replica, cost)
    want = [cost.stage_time(replica.config, lengths[mb], replica.policy(int(lengths[mb].sum()), len(micro_batches)))
            for mb in micro_batches]
    assert tokens.tolist() == [int(lengths[mb].sum()) for mb in micro_batches]
    assert times.tolist() == want


LONG_COST = load_cost_model("llama-70b@h100-80g+cp").with_policies(True)
LONG_POOL = [Deployment.parse(t, ClusterSpec(128)) for t in
             ("1x(tp1,pp8,cp8) + 4x(tp2,pp4,cp2)", "2x(tp1,pp8,cp8)", "1x(tp1,pp8,cp8) + 8x(tp1,pp8)")]


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 2), st.floats(0.0, 10.0))
def test_a_sequence_held_only_alone_never_shares_past_the_lone_cap(seed, longs, spread):
    """tp1pp8cp8 on 128 GPUs (70b) holds 131,072 tokens only as a replica's lone micro-batch (plain cap 9,728,
    reach 128,512, lone cap 403,456): dispatch, whatever its bias (the refinement rounds'), never gives such a
    replica more than its lone cap, and planning either plans or names a pool without room; never "longer than
    the micro-batch cap" (seen once with policies on a hand-written 70b-128g pool, not reproduced)."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(64, 30_000, int(rng.integers(5, 120))), [131072] * longs])
    for d in LONG_POOL:
        table = ReplicaTable.of(LONG_COST, d, 128)
        reach = np.array([r.reach for r in table.replicas])
        try:
            found = dispatch(lengths, table, rng.normal(0.0, spread, len(table)))
        except NoRoom:
            continue
        for r, members in enumerate(found.all_members()):
            if len(members) and lengths[members].max() > reach[r]:
                assert lengths[members].sum() <= table.lone_cap[r]
    try:
        Planner(LONG_COST, 128, LONG_POOL).plan(lengths)
    except HydraulisError as e:
        assert "no deployment of the pool has room" in str(e)


def test_a_config_that_always_recomputes_runs_full_whatever_its_plan_lists():
    """One rule (`policy_run`): a plan's None is the config's plain policy, and a config of the recompute set runs
    full whatever its plan lists (its model checkpoints every block). The runtime's batches read None as none and
    the memory meter an explicit none as full, where the step's counts and the plan's caps read them as listed."""
    from hydraulis.planner.plan import plan_from_assignment

    g = P(1, 2)
    full = TIGHT.with_recompute([g])
    listed = (None, MemoryPolicy.NONE, MemoryPolicy.SELECTIVE, MemoryPolicy.FULL)
    assert {full.policy_run(c, p) for c in (g, g.interleaved(2)) for p in listed} == {MemoryPolicy.FULL}
    assert [POLICIES.policy_run(g, p) for p in listed] == [MemoryPolicy.NONE, *listed[1:]]
    lone = full.policy_cap(g, 2, MemoryPolicy.FULL, 1)
    assert lone > TIGHT.lone_cap(g, 2)  # a lone micro-batch only full recompute holds, its plan listing none
    plan = plan_from_assignment(0, [lone], Deployment.parse("1x(tp1,pp2)", ClusterSpec(2)), [[[0]]], 0.0,
                                policies=[[MemoryPolicy.NONE]])
    plan.validate(full, 2)


def test_a_micro_batch_runs_the_lightest_policy_its_replicas_own_count_holds():
    """Fewer micro-batches than the worst count keep fewer chunks in flight (interleaved, a count whose group is pp;
    1F1B, below pp): a micro-batch past a policy's any-count cap runs it where its count's cap holds it, the plan
    validates at that count, and the same micro-batch under a lighter policy than its count holds does not. Past the
    any-count cap's horizon a count may hold less than it: a micro-batch at that cap runs a heavier policy there."""
    cost = LONG_COST.with_interleaving()
    deployment = Deployment.parse("1x(tp1,pp8,cp16,vp5)", ClusterSpec(128))
    config = deployment.configs[0]
    replica = ReplicaCost.of(cost, config, 128)
    longest = (cost.policy_cap(config, 128, MemoryPolicy.SELECTIVE) + cost.micro_batch_cap(
        config, 128, 16, MemoryPolicy.SELECTIVE)) // 2  # past selective's any-count cap, within its cap at 16
    assert longest > cost.policy_cap(config, 128, MemoryPolicy.NONE, 16)
    lengths = np.array([longest] + [4096] * 15)
    plan = assemble(0, lengths, deployment, [[[k] for k in range(16)]], ReplicaTable.of(cost, deployment, 128))
    assert plan.policy(0, 0) == MemoryPolicy.SELECTIVE and replica.policy(longest, 16) == MemoryPolicy.SELECTIVE
    assert replica.policy(longest, worst_count(config, 0)) == MemoryPolicy.FULL  # the any-count cap's own count
    beyond = 1446  # pp 8: a group of 21, past every count's to the horizon (`worst_counts`), so a cap below its
    assert interleave_group(8, beyond) > max(interleave_group(8, m) for m in range(2, COUNT_HORIZON + 1))
    assert cost.micro_batch_cap(config, 128, beyond, MemoryPolicy.NONE) < replica.cap
    assert replica.policy(replica.cap, beyond) == MemoryPolicy.SELECTIVE
    plan.validate(cost, 128)
    plain = dataclasses.replace(plan, replicas=(dataclasses.replace(plan.replicas[0], policies=()),))
    with pytest.raises(HydraulisError, match="over its cap"):
        plain.validate(cost, 128)


def test_a_batch_packs_at_the_caps_of_the_counts_it_may_pack_and_holds_at_its_own():
    """A batch of n sequences packs at most n micro-batches on a replica, so its decisions read the least cap of
    counts 2..n (`count_horizon`), not of every count to COUNT_HORIZON: four 64K pieces fit llama-70b
    tp1pp8cp8vp5 at 64 GPUs beside others under full recompute for a batch of 16 (its cap for every count, 54,272,
    left each to a lone micro-batch: no room for the batch), and the plan holds, by the memory model at its own
    count, every micro-batch under the policy it runs."""
    cost = load_cost_model("llama-70b@h100-80g+cp").with_interleaving().with_policies(True)
    deployment = Deployment.parse("1x(tp1,pp8,cp8,vp5)", ClusterSpec(64))
    config = deployment.configs[0]
    lengths = np.array([65536] * 4 + [8192] * 12)
    assert ReplicaCost.of(cost, config, 64).reach < 65536 <= ReplicaCost.of(cost, config, 64, len(lengths)).reach
    with pytest.raises(NoRoom):
        dispatch(lengths, ReplicaTable.of(cost, deployment, 64))
    plan = Planner(cost, 64, [deployment]).plan(lengths)
    plan.validate(cost, 64)
    micro_batches = plan.replicas[0].micro_batches
    assert len(micro_batches) > 4
    for m, mb in enumerate(micro_batches):
        ran = cost.policy_run(config, plan.policy(0, m))
        tokens = int(lengths[list(mb)].sum())
        for stage in (0, config.pp - 1):
            rank = rank_memory(cost.memory, cost.model, config, stage=stage, num_gpus=64, tokens=tokens,
                               dtype_bytes=cost.memory.compute_dtype_bytes,
                               bucket_bytes=cost.memory.exchange_bucket_bytes, recompute=ran,
                               micro_batches=len(micro_batches))
            assert rank.peak <= cost.memory.usable_bytes, (m, tokens, ran, stage)


def _fields(r: ReplicaCost) -> tuple:
    return tuple(getattr(r, f.name) for f in dataclasses.fields(r) if f.compare)


def test_a_kept_replica_is_the_one_built_afresh_and_a_changed_model_builds_its_own():
    """`ReplicaCost.of` keeps each model's replicas (the proposal's trial planners ask again): the same fields as a
    build on a model that kept none, and a copy with another attribute (a policy's measured scale) its own."""
    from hydraulis.planner import replicas

    cost = load_cost_model("llama-7b@a800-80g").with_interleaving().with_policies(True)
    configs = [g for g in cost.configs if g.num_gpus <= 16][:12]
    kept = [ReplicaCost.of(cost, g, 16, most) for g in configs for most in (3, COUNT_HORIZON)]
    assert all(a is b for a, b in zip(kept, [ReplicaCost.of(cost, g, 16, m) for g in configs
                                             for m in (3, COUNT_HORIZON)], strict=True))
    for r in kept:
        r.steps(5)  # a kept replica's steps found: the next planner reads them
    replicas._KEPT.clear()
    fresh = [ReplicaCost.of(cost, g, 16, most) for g in configs for most in (3, COUNT_HORIZON)]
    assert [_fields(a) for a in kept] == [_fields(b) for b in fresh]
    assert all(np.array_equal(a.steps(5)[0], b.steps(5)[0]) and a.steps(5)[1] == b.steps(5)[1]
               for a, b in zip(kept, fresh, strict=True))
    scaled = POLICIES.with_policies(True)
    before = ReplicaCost.of(scaled, P(1, 1), 4)
    scaled.policy_scales = {P(1, 1): {MemoryPolicy.SELECTIVE: (1.6, 1.6), MemoryPolicy.FULL: (1.5, 1.5)}}
    after = ReplicaCost.of(scaled, P(1, 1), 4)
    replicas._KEPT.clear()
    assert after is not before and _fields(after) == _fields(ReplicaCost.of(scaled, P(1, 1), 4))
