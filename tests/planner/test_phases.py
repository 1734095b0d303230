"""Phases within an iteration: the planner's choice, its schedule's time, and the schedule's wire and file forms."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment
from hydraulis.planner.phases import CUT_PLANS, FULL_SPLITS, MAX_PHASES, TOP_CUTS, PhasedPlanner, Split
from hydraulis.planner.plan import (
    PlanFile,
    Schedule,
    decode_schedule,
    encode_plan,
    encode_schedule,
    load_plan,
    save_plan,
)
from hydraulis.planner.planner import Planner
from hydraulis.planner.proposal.propose import propose
from hydraulis.planner.schedule import check_schedule, mean_switch_time, phases_time
from hydraulis.planner.sim import simulate
from hydraulis.specs import ClusterSpec

CLUSTER = ClusterSpec(16)
BIG = load_cost_model("llama-32b@a800-80g")  # on 16 GPUs only tp16pp1 holds 24K
BIG_POOL = ("1x(tp16,pp1)", "1x(tp8,pp2)")
LONG = 24576  # over the caps of tp8pp2 (17,408) and tp8pp1cp2 (23,424), within tp16pp1's (29,184)
SMALL = load_cost_model("llama-7b@a800-80g")
SMALL_POOL = ("4x(tp4,pp1)", "8x(tp2,pp1)", "1x(tp8,pp1) + 4x(tp2,pp1)", "8x(tp1,pp2)")


@functools.cache
def planner(name: str) -> PhasedPlanner:
    cost, pool = (BIG, BIG_POOL) if name == "big" else (SMALL, SMALL_POOL)
    return PhasedPlanner(cost, CLUSTER.num_gpus, [Deployment.parse(t, CLUSTER) for t in pool])


def code_batch(seed: int = 0) -> np.ndarray:
    """A code-like batch: six documents at the 24K maximum, forty shorter ones."""
    rng = np.random.default_rng(seed)
    return np.concatenate([[LONG] * 6, np.minimum(rng.lognormal(7.8, 0.8, 40).astype(np.int64) + 64, 11000)])


def by_hand(schedule: Schedule, cost) -> float:
    """Each phase's simulated compute, one exchange (reduce and gather) per switch, the step's exchange at the end."""
    compute = sum(simulate(p, cost, keep_events=False).compute_time_s for p in schedule.phases)
    return compute + len(schedule.phases) * cost.grad_sync_time(CLUSTER.num_gpus)


def test_long_sequences_get_their_own_phase_when_that_pays():
    """One deployment must hold the 24K documents; in phases the rest run on the faster tp8pp2, the long ones last."""
    p = planner("big")
    b = code_batch()
    schedule = p.schedule(b, step=3)
    check_schedule(schedule, BIG)
    assert len(schedule.phases) == 2
    first, last = schedule.phases
    assert str(last.deployment) == "1x(tp16,pp1)" and str(first.deployment) == "1x(tp8,pp2)"
    assert sorted(last.lengths)[-6:] == [LONG] * 6 and max(first.lengths) <= BIG.cap(first.deployment.configs[0], 16)
    assert schedule.iteration_time_s == pytest.approx(by_hand(schedule, BIG), rel=1e-12)
    single = Planner(BIG, CLUSTER.num_gpus, p.pool).plan(b, 3)
    assert schedule.iteration_time_s < 0.95 * single.predicted_time_s  # 0.91 (0.89 when tp8pp2 held 11,264)
    assert schedule.switch_s == BIG.grad_sync_time(CLUSTER.num_gpus)
    assert schedule.planning_time_s > 0 and schedule.step == 3


def test_one_deployment_when_phases_do_not_pay():
    """Short sequences all fit the fast deployment: a second phase would only add a switch."""
    schedule = planner("big").schedule(np.array([3000, 2000, 900] * 8), 0)
    assert len(schedule.phases) == 1 and str(schedule.phases[0].deployment) == "1x(tp8,pp2)"
    assert schedule.iteration_time_s == schedule.phases[0].predicted_time_s
    assert schedule.planning_time_s == schedule.phases[0].planning_time_s > 0


def test_neighbouring_phases_on_one_deployment_are_planned_as_one_where_that_is_faster():
    """tiny at 26 MiB per rank on 4 ranks: the best split's ranges, each planned on its own, put the 85 and the
    1,408 tokens on one deployment in two phases, one replica busy in each; one phase on it runs both at once
    and saves a switch, and the planner takes it."""
    cost = load_cost_model("tiny@cpu-measured").for_job(26 << 20, 4)  # fp32, as the quick start
    cluster = ClusterSpec(4)
    pool = [Deployment.parse(t, cluster) for t in ("1x(tp4,pp1)", "1x(tp1,pp2) + 1x(tp2,pp1)", "4x(tp1,pp1)")]
    b = np.array([2048, 85, 1408, 27, 15, 2048, 132, 2048])
    p = PhasedPlanner(cost, 4, pool)
    apart = []  # each range of the splits the planner plans in full, planned on its own (as before the merge)
    for split in p.splits(b)[:FULL_SPLITS]:
        plans = [(p._later_planner() if k else p).plan(b[idx], 0) for k, idx in enumerate(split.phases)]
        apart.append((phases_time(plans, cost, mean_switch_time(plans, cost)), [str(x.deployment) for x in plans]))
    repeated = [t for t, names in apart if any(x == y for x, y in zip(names, names[1:], strict=False))]
    assert repeated  # not vacuous: a split planned apart runs one deployment in consecutive phases
    schedule = p.schedule(b)
    check_schedule(schedule, cost)
    names = [str(x.deployment) for x in schedule.phases]
    assert not any(x == y for x, y in zip(names, names[1:], strict=False)), names
    assert schedule.iteration_time_s < min(repeated) and schedule.iteration_time_s <= min(t for t, _ in apart)


def test_a_deployment_runs_consecutive_phases_where_a_sequence_fits_only_as_its_replicas_only_micro_batch():
    """llama-32b on 16 GPUs: 14,810 and 14,485 tokens exceed tp8pp1's cap beside other micro-batches (in a later
    phase 11,520) but fit as a replica's only one (15,360), so 2x(tp8,pp1) runs them in a phase of their own after
    the shorter ones; in one phase on it they find no room, and the planner keeps the two."""
    cluster = ClusterSpec(16)
    pool = [Deployment.parse(t, cluster) for t in ("1x(tp16,pp1)", "2x(tp8,pp1)", "1x(tp8,pp2)")]
    rng = np.random.default_rng(6)
    b = np.concatenate([[int(rng.integers(12000, 24576))] * int(rng.integers(1, 5)),
                        np.minimum(rng.lognormal(7.8, 1.0, 40).astype(np.int64) + 64, 20000)])
    p = PhasedPlanner(BIG, 16, pool)
    schedule = p.schedule(b)
    check_schedule(schedule, BIG)
    names = [str(x.deployment) for x in schedule.phases]
    assert names == ["2x(tp8,pp1)", "2x(tp8,pp1)", "1x(tp16,pp1)"]
    tp8, later = pool[1].configs[0], BIG.later_phase()
    second = schedule.phases[1]
    assert all(len(r.micro_batches) == 1 for r in second.replicas)
    alone = [int(second.micro_batch_lengths(r)[0].sum()) for r in range(len(second.replicas))]
    assert all(later.cap(tp8, 16) < t <= later.lone_cap(tp8, 16) for t in alone), alone
    with pytest.raises(HydraulisError, match="no replica has room"):
        p.plan_on(b[[*schedule.indices[0], *schedule.indices[1]]], pool[1])


def test_plan_on_within_the_phased_planners_memo_is_plan_on_without_it():
    """A merge of phases plans the merged part with `plan_on`, which within the memo takes the screen's packed
    candidate of that pool deployment (`Planner._packed`) or packs it there: the plan of planning it afresh."""
    pool = [Deployment.parse(t, CLUSTER) for t in SMALL_POOL]
    b = np.random.default_rng(4).integers(200, 9000, 48)
    kept = Planner(SMALL, CLUSTER.num_gpus, pool, memo={})
    kept.plan(b)  # packs the deployments its screen keeps
    assert any(("packed", d, b.tobytes()) in kept._memo for d in pool)  # not vacuous: some are taken from the memo
    for d in pool:
        got, want = kept.plan_on(b, d), Planner(SMALL, CLUSTER.num_gpus, pool).plan_on(b, d)
        assert got.replicas == want.replicas and got.predicted_time_s == want.predicted_time_s


def test_the_later_phases_cost_model_is_one_while_its_cost_model_stays_as_it_was():
    """Phased planners, checks and meters of one cost model share one later-phase copy (its caps computed once); a
    cost model changed since, or a copy for a job's budget, gets a fresh one with its own memory model."""
    cost = copy.copy(SMALL)
    later = cost.later_phase()
    assert cost.later_phase() is later and later.memory.reduced_held and not cost.memory.reduced_held
    g = next(c for c in cost.configs if c.num_gpus <= CLUSTER.num_gpus)
    by_hand = copy.copy(cost)
    by_hand.memory = dataclasses.replace(cost.memory, reduced_held=True)
    assert later.cap(g, CLUSTER.num_gpus) == by_hand.cap(g, CLUSTER.num_gpus) < cost.cap(g, CLUSTER.num_gpus)
    job = cost.for_job(40 * 2**30, 2)
    assert job.later_phase().memory == dataclasses.replace(job.memory, reduced_held=True) != later.memory
    cost.name = "renamed"
    assert cost.later_phase() is not later and cost.later_phase().name == "renamed"


def test_a_phase_after_the_first_is_checked_within_the_later_phases_caps():
    """`check_schedule` holds a phase after the first to the caps beside the earlier phases' reduced gradient: the
    same plans, with the packed phase run second, put a micro-batch over its later cap and are refused."""
    cluster = ClusterSpec(16)
    pool = [Deployment.parse(t, cluster) for t in ("1x(tp16,pp1)", "2x(tp8,pp1)", "1x(tp8,pp2)")]
    rng = np.random.default_rng(6)
    b = np.concatenate([[int(rng.integers(12000, 24576))] * int(rng.integers(1, 5)),
                        np.minimum(rng.lognormal(7.8, 1.0, 40).astype(np.int64) + 64, 20000)])
    schedule = PhasedPlanner(BIG, 16, pool).schedule(b)
    check_schedule(schedule, BIG)
    first = schedule.phases[0]
    packed = max(int(s.sum()) for r, replica in enumerate(first.replicas) if len(replica.micro_batches) > 1
                 for s in first.micro_batch_lengths(r))
    config = first.deployment.replicas[0].config
    assert BIG.later_phase().cap(config, 16) < packed <= BIG.cap(config, 16)  # not vacuous
    order = (1, 0, *range(2, len(schedule.phases)))
    swapped = dataclasses.replace(schedule, phases=tuple(schedule.phases[k] for k in order),
                                  indices=tuple(schedule.indices[k] for k in order))
    with pytest.raises(HydraulisError, match="phase 1"):
        check_schedule(swapped, BIG)


def test_splits_cut_after_the_longest_sequences_too():
    """llama-7b on 16 GPUs: 60K, 45K and 40K among 60 short sequences. No pool cap falls between 45K and 60K, so cut
    only at caps the 45K and 40K share the 60K's phase (estimated 12.4 s); the batch is cut after its k longest too
    (k of TOP_CUTS), and the best split's estimate is the least of every such two-phase cut (10.9 s or less)."""
    p = planner("small")
    b = np.concatenate([[60000, 45000, 40000], np.random.default_rng(0).integers(500, 9000, 60)])
    s = np.sort(b)
    lone = np.array(p.caps())
    by_count = [p._estimate(s[:-k], lone) + p._estimate(s[-k:], lone) + p.switch_s for k in TOP_CUTS if k < len(s)]
    best = p.splits(b)[0]
    assert best.estimate_s <= min(by_count) * (1 + 1e-12)
    at_caps = p.splits(b, top_cuts=())[0]
    assert any({60000, 45000} <= set(b[part].tolist()) for part in at_caps.phases)
    assert best.estimate_s < 0.9 * at_caps.estimate_s


def mixed_batch(seed: int) -> np.ndarray:
    """A few sequences of 20-74K among 20-80 short ones."""
    rng = np.random.default_rng(seed)
    longs = rng.integers(20000, 74000, rng.integers(2, 12))
    return np.concatenate([longs, rng.integers(500, 9000, rng.integers(20, 80))])


def test_the_last_phases_cut_moves_where_a_neighbouring_cut_simulates_faster():
    """llama-7b on 16 GPUs, 4 long sequences among 63 short ones: the estimate's best split plans 12 sequences in the
    long phase; moved by simulation (`_refine_cut`), 13 run there and the iteration is 1% faster. The schedule
    holds every sequence within its caps, its time is its phases' simulation, its last phase the longest."""
    b = mixed_batch(38)
    pool = planner("small").pool
    fixed = PhasedPlanner(SMALL, CLUSTER.num_gpus, pool, cut_plans=0).schedule(b)
    moved = PhasedPlanner(SMALL, CLUSTER.num_gpus, pool).schedule(b)
    assert [len(i) for i in fixed.indices] == [55, 12] and [len(i) for i in moved.indices] == [54, 13]
    assert moved.iteration_time_s < 0.995 * fixed.iteration_time_s
    check_schedule(moved, SMALL)
    assert moved.iteration_time_s == pytest.approx(by_hand(moved, SMALL), rel=1e-12)
    assert sorted(b[list(moved.indices[-1])].tolist()) == sorted(b.tolist())[-13:]


def test_three_phases_are_tried_as_two_at_the_moved_cut():
    """A three-phase split (the 4 sequences below the 10 longest apart) moved by one plan, then its first two
    phases as one: two phases, faster than the three given and than the two at the cut given."""
    b = mixed_batch(0)
    n, order = len(b), np.argsort(b, kind="stable")
    p = PhasedPlanner(SMALL, CLUSTER.num_gpus, planner("small").pool, cut_plans=1)
    three = p._plan_split(b, Split((order[: n - 14], order[n - 14 : n - 10], order[n - 10 :]), 0.0), 0)
    two = p._plan_split(b, Split((order[: n - 10], order[n - 10 :]), 0.0), 0)
    out = p._refine_cut(b, (n - 14, 4, 10), three, 0)
    check_schedule(out, SMALL)
    assert len(out.phases) == 2 and out.iteration_time_s < min(three.iteration_time_s, two.iteration_time_s)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), plans=st.integers(1, CUT_PLANS))
def test_a_moved_cut_is_never_slower_than_the_estimates_split(seed, plans):
    """Whatever the batch and the plans allowed, the schedule with the cut moved is no slower than without, and
    holds every sequence within its caps."""
    b = mixed_batch(seed)
    pool = planner("small").pool
    fixed = PhasedPlanner(SMALL, CLUSTER.num_gpus, pool, cut_plans=0).schedule(b)
    moved = PhasedPlanner(SMALL, CLUSTER.num_gpus, pool, cut_plans=plans).schedule(b)
    check_schedule(moved, SMALL)
    assert moved.iteration_time_s <= fixed.iteration_time_s



def compute_s(plan) -> float:
    return simulate(plan, SMALL, keep_events=False).compute_time_s


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), share=st.sampled_from([0.9, 0.999, 1.0, 1.001, 1.1]), memo=st.booleans())
def test_a_plan_within_a_beat_gives_up_only_where_it_is_as_slow(seed, share, memo):
    """`plan_within` on each deployment: None only where `plan_on`'s slowest replica takes `beat` or more, else
    `plan_on`'s plan (with a refinement round on the pipelined 8x(tp1,pp2), without on the others); a phase's
    plan (`outlook=False`: a deployment after the first gives up once it loses) is the plan of each packed in full."""
    b = np.random.default_rng(seed).integers(300, 4000, 60)  # every deployment holds it
    ours = Planner(SMALL, 16, planner("small").pool, memo={} if memo else None)
    for d in [d for d in ours.pool if ours.holds(d, int(b.max()))]:
        full = Planner(SMALL, 16, ours.pool).plan_on(b, d)
        got = ours.plan_within(b, d, beat=share * compute_s(full))
        if got is None:
            assert compute_s(full) >= share * compute_s(full)
        else:
            assert got.replicas == full.replicas and got.predicted_time_s == full.predicted_time_s
    every = Planner(SMALL, 16, ours.pool)  # each deployment it packs, packed in full
    every._packed = lambda lengths, k, d, beat=np.inf: Planner._packed(every, lengths, k, d)  # type: ignore[method-assign]
    chosen, want = ours.plan(b, outlook=False), every.plan(b)
    assert chosen.replicas == want.replicas and chosen.predicted_time_s == want.predicted_time_s


def test_a_moved_cut_gives_up_on_the_bulk_only_where_it_loses():
    """`_plan_split` with the phases' deployments and a time to beat: None only where the split planned in full
    takes that long or more (so `_refine_cut` keeps what it kept), else the same schedule; below its time the
    bulk's packing gives up (the case `_refine_cut`'s losing cuts are)."""
    b = mixed_batch(38)
    n, order = len(b), np.argsort(b, kind="stable")
    p = PhasedPlanner(SMALL, CLUSTER.num_gpus, planner("small").pool)
    for k in (11, 12, 13, 14):
        split = Split((order[: n - k], order[n - k :]), 0.0)
        full = p._plan_split(b, split, 0)
        on = tuple(q.deployment for q in full.phases)
        assert len(on) == 2 and on[0] != on[1]
        assert p._plan_split(b, split, 0, on, 0.99 * full.iteration_time_s) is None
        for share in (1.0001, 1.01):
            got = p._plan_split(b, split, 0, on, share * full.iteration_time_s)
            assert got is not None and got.iteration_time_s == full.iteration_time_s
            assert [q.replicas for q in got.phases] == [q.replicas for q in full.phases]

LARGEST = 74_000  # below tp8pp1's cap on 16 GPUs
batches = st.lists(
    st.one_of(st.integers(8, 2048), st.integers(2048, 20000), st.integers(20000, LARGEST)), min_size=1, max_size=80
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches, step=st.integers(0, 5))
def test_schedule_invariants(batch, step):
    """Every sequence in exactly one phase within its caps, phases on pool deployments, the time as simulated,
    never slower than the best single deployment the planner finds."""
    p = planner("small")
    lengths = np.array(batch)
    schedule = p.schedule(lengths, step)
    check_schedule(schedule, SMALL)
    assert schedule.lengths == tuple(batch) and schedule.step == step
    assert 1 <= len(schedule.phases) <= MAX_PHASES
    assert all(plan.deployment in p.pool for plan in schedule.phases)
    if len(schedule.phases) > 1:
        assert schedule.iteration_time_s == pytest.approx(by_hand(schedule, SMALL), rel=1e-12)
    single = Planner(SMALL, CLUSTER.num_gpus, p.pool).plan(lengths, step)
    assert schedule.iteration_time_s <= single.predicted_time_s * (1 + 1e-9)


def test_wire_format_round_trips_and_leaves_one_phase_as_it_was():
    p = planner("big")
    for b in (code_batch(1), np.array([3000, 2000, 900] * 4)):
        schedule = p.schedule(b, 7)
        data = encode_schedule(schedule, p.pool)
        assert decode_schedule(data, 7, b, p.pool) == schedule
        if len(schedule.phases) == 1:  # a plan without phases travels exactly as before
            plan = schedule.phases[0]
            assert np.array_equal(data, encode_plan(plan, p.pool.index(plan.deployment)))
        else:
            assert data[0] == -len(schedule.phases)


def test_plan_file_holds_phases_and_refuses_a_phase_that_leaves_a_sequence_out(tmp_path):
    p = planner("big")
    schedules = (p.schedule(code_batch(2), 0), p.schedule(np.array([3000, 2000]), 1))
    path = tmp_path / "plan.json"
    save_plan(path, PlanFile(BIG.name, 16, schedules))
    assert load_plan(path).iterations == schedules
    import json

    data = json.loads(path.read_text())
    assert "phases" in data["iterations"][0] and "phases" not in data["iterations"][1]
    data["iterations"][0]["phases"][0]["indices"].pop()
    path.write_text(json.dumps(data))
    with pytest.raises(HydraulisError, match="iterations\\[0\\]"):
        load_plan(path)


def test_proposal_adds_a_deployment_no_whole_batch_would_choose():
    """Every sample holds a 24K document, so only tp16pp1 runs whole batches; phases want tp8pp2 beside it."""
    sample = [code_batch(s) for s in range(4)]
    proposal = propose(BIG, CLUSTER, sample, max_pool=3)
    texts = [str(d) for d in proposal.pool.deployments]
    assert texts[0] == "1x(tp16,pp1)" and len(texts) >= 2
    assert proposal.pool.usage is not None and all(u > 0 for u in proposal.pool.usage)
    assert proposal.phased_times_s is not None
    assert (proposal.best_times_s < proposal.times_s[0]).all()


BIG_CP = load_cost_model("llama-32b@a800-80g+cp")
CP_POOL = ("1x(tp8,pp1,cp2)", "1x(tp4,pp2,cp2)", "2x(tp4,pp2)")


@functools.cache
def cp_planner() -> PhasedPlanner:
    return PhasedPlanner(BIG_CP, CLUSTER.num_gpus, [Deployment.parse(t, CLUSTER) for t in CP_POOL])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), longs=st.integers(0, 8))
def test_phases_on_cp_deployments_hold_their_caps_and_never_lose_to_one_phase(seed, longs):
    """Code-like batches on a pool with a CP deployment for the middle range: every phase on a pool deployment
    within its caps, and the schedule never slower than the one-phase plan."""
    rng = np.random.default_rng(seed)
    short = np.minimum(rng.lognormal(8.2, 0.9, 40).astype(np.int64) + 64, 16000)
    b = np.concatenate([np.full(longs, 16384, dtype=np.int64), short])
    p = cp_planner()
    schedule = p.schedule(b, 0)
    check_schedule(schedule, BIG_CP)
    assert all(plan.deployment in p.pool for plan in schedule.phases)
    single = Planner(BIG_CP, CLUSTER.num_gpus, p.pool).plan(b, 0)
    assert schedule.iteration_time_s <= single.predicted_time_s * (1 + 1e-9)


def test_proposal_offers_hotspas_cp_phase_and_the_planner_keeps_up_with_hotspa():
    """32b on 16 GPUs: hotspa runs the sequences up to 11K on tp4pp2cp2, a CP config no candidate deployment
    holds (it holds no 24K document); the proposal offers every homogeneous deployment for phases, so the pool
    holds it and the phased planner is at least as fast as hotspa on every batch. (With 20K documents
    tp8pp1cp2 holds them all and the proposal keeps it alone: 3-6% behind hotspa's tp4pp2cp2 phase.)"""
    from hydraulis.baselines.hotspa import HotSpa
    from hydraulis.planner.policy import PolicyContext

    sample = [code_batch(s) for s in range(4)]
    proposal = propose(BIG_CP, CLUSTER, sample)
    texts = [str(d) for d in proposal.pool.deployments]
    assert "1x(tp4,pp2,cp2)" in texts
    planner_ = PhasedPlanner(BIG_CP, CLUSTER.num_gpus, proposal.pool.deployments)
    hotspa = HotSpa(PolicyContext.build(BIG_CP, CLUSTER, sample))
    for seed in range(4, 7):
        b = code_batch(seed)
        ours, theirs = planner_.schedule(b), hotspa.schedule(b)
        assert all(plan.deployment in planner_.pool for plan in ours.phases)
        assert ours.iteration_time_s <= theirs.iteration_time_s * (1 + 1e-9)


def test_short_share_is_the_chance_that_a_batch_stops_at_the_level():
    from hydraulis.planner.proposal.phased import short_share

    batches = [np.array([100, 200, 300, 5000]), np.array([100, 200, 300, 400])]
    assert short_share(batches, 5000) == 1.0
    assert short_share(batches, 400) == pytest.approx((1 - 1 / 8) ** 4)
    assert short_share(batches, 50) == 0.0


def test_a_deployment_for_short_batches_counts_where_batches_often_stop_short():
    """Samples that each hold one 24K document: tp8pp2 runs the rest faster than tp16pp1; where a third of
    batches have none, the samples cut at its cap count, and where almost none do they do not."""
    from hydraulis.planner.proposal.phased import _short_cuts

    pool = [Deployment.parse(BIG_POOL[0], CLUSTER)]
    fast = Deployment.parse(BIG_POOL[1], CLUSTER)
    level = BIG.cap(fast.configs[0], 16)
    rng = np.random.default_rng(5)
    often = [np.concatenate([[LONG], rng.integers(1000, 8000, 9)]) for _ in range(4)]
    before, after = PhasedPlanner(BIG, 16, pool), PhasedPlanner(BIG, 16, [*pool, fast])
    cuts = _short_cuts(often, level)
    assert [len(b) for b in cuts.values()] == [9] * 4  # each sample without its long document
    saved = sum(before.schedule(b).iteration_time_s - after.schedule(b).iteration_time_s for b in cuts.values())
    assert saved > 0.05 * sum(before.schedule(b).iteration_time_s for b in cuts.values())
    rarely = [code_batch(s) for s in range(4)]  # six 24K documents in 46: a batch without one is rare
    assert _short_cuts(rarely, level) == {}


def test_the_outlook_is_each_deployments_own_plan_against_the_chosen_one():
    """Why a run kept one deployment (run_log.kept_one): per step, each pool deployment's predicted time over the
    chosen one's, as planning the batch on that deployment alone predicts it; inf where it cannot hold it."""
    from hydraulis.planner.pool import parse_pool

    pool = parse_pool("1x(tp2,pp1) + 2x(tp1,pp1); 2x(tp1,pp2); 4x(tp1,pp1)", ClusterSpec(4))
    tiny = PhasedPlanner(load_cost_model("tiny@cpu"), 4, pool)
    rng = np.random.default_rng(0)
    for step in range(3):
        lengths = rng.integers(10, 256, size=12)
        chosen = tiny.schedule(lengths, step).phases[0]
        alone = [tiny.plan_on(lengths, d, step).predicted_time_s / chosen.predicted_time_s for d in pool]
        np.testing.assert_allclose(tiny.outlook[step], alone, rtol=1e-9)
        assert min(tiny.outlook[step]) == 1.0
    # Under 40 MiB a tp1pp1 replica holds 1,792 tokens alone: 4x(tp1,pp1) cannot hold a batch with 2,000.
    budgeted = load_cost_model("tiny@cpu-measured").for_job(40 << 20, 4, 64 << 20, False)
    two = PhasedPlanner(budgeted, 4, pool[::2])
    assert two.caps() == (2944, 1792)
    two.schedule(np.array([2000, 100, 200, 300, 50]), 7)
    assert two.outlook == {7: (1.0, float("inf"))}


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 12), switch=st.sampled_from([0.0, 0.05, 5.0]))
def test_hotspas_split_is_the_best_over_every_cut_at_the_caps(seed, n, switch):
    """homogeneous_split (hotspa's and the proposal's) against every split of the sorted batch at the caps, each
    range on its best config by `homogeneous_estimate`, enumerated by brute force."""
    import itertools

    from hydraulis.planner.phases import homogeneous_split
    from hydraulis.planner.pool import homogeneous_estimate, replicable_configs

    cost = load_cost_model("llama-32b@a800-80g+cp")
    configs = replicable_configs(cost, CLUSTER)
    caps = [cost.cap(g, 16) for g in configs]
    b = np.random.default_rng(seed).integers(64, max(caps) + 1, n)
    s = np.sort(b)
    cuts = sorted({int(np.searchsorted(s, c, side="right")) for c in caps} - {0, n})

    def total(bounds: list[int]) -> float:
        parts = [s[i:j] for i, j in itertools.pairwise([0, *bounds, n])]
        return sum(min(homogeneous_estimate(cost, g, 16, [p]) for g, c in zip(configs, caps, strict=True)
                       if c >= p[-1])
                   for p in parts) + switch * (len(parts) - 1)

    best = min(total(list(k)) for r in range(len(cuts) + 1) for k in itertools.combinations(cuts, r))
    split = homogeneous_split(cost, 16, configs, b, switch)
    assert sorted(i for idx, _ in split for i in idx.tolist()) == list(range(n))
    ours = sum(homogeneous_estimate(cost, configs[k], 16, [b[idx]]) for idx, k in split) + switch * (len(split) - 1)
    assert all(caps[k] >= b[idx].max() for idx, k in split)
    assert ours == pytest.approx(best, rel=1e-9)


def test_hotspas_phases_enter_the_pool_together_where_neither_pays_alone():
    """32b on 16 GPUs, code up to 16K (the bench's 32b-16g-code): hotspa runs tp4pp2cp2 up to 11K, then
    tp8pp1cp2; beside the fallback tp8pp2 neither saves anything alone, so the proposal offers them as one
    move, and the phased planner on its pool keeps up with hotspa on fresh batches."""
    from hydraulis.baselines.hotspa import HotSpa
    from hydraulis.bench import get_scenarios
    from hydraulis.planner.policy import PolicyContext

    scenario = get_scenarios(["32b-16g-code-256k-16k"])[0]
    cost = load_cost_model(scenario.profile)
    sample = scenario.sample(scenario.seed + 1000, 4)
    texts = [str(d) for d in propose(cost, CLUSTER, sample).pool.deployments]
    assert {"1x(tp4,pp2,cp2)", "1x(tp8,pp1,cp2)"} <= set(texts), texts
    ours = PhasedPlanner(cost, 16, [Deployment.parse(t, CLUSTER) for t in texts])
    batches = scenario.sample(scenario.seed)
    hotspa = HotSpa(PolicyContext.build(cost, CLUSTER, batches, sample=sample))
    for b in batches:
        assert ours.schedule(b).iteration_time_s <= hotspa.schedule(b).iteration_time_s * (1 + 1e-9)


def test_planners_sharing_a_memo_plan_as_planners_without_one():
    """The proposal's trials share a memo of each deployment's dispatch and packed plan per batch: a planner
    on a larger pool that reads what one on a smaller pool memoised plans exactly as a fresh one."""
    pool = [Deployment.parse(t, CLUSTER) for t in BIG_POOL]
    memo: dict = {}
    first = PhasedPlanner(BIG, 16, pool[:1], memo=memo)
    both = PhasedPlanner(BIG, 16, pool, memo=memo)
    for seed in range(3):
        b = code_batch(seed)
        first.schedule(b)
        ours, fresh = both.schedule(b), PhasedPlanner(BIG, 16, pool).schedule(b)
        assert ours.iteration_time_s == fresh.iteration_time_s
        assert [p.replicas for p in ours.phases] == [p.replicas for p in fresh.phases]
    assert memo and "later" in memo


def test_a_batchs_own_memo_plans_as_none(monkeypatch):
    """A planner without a memo keeps one per batch (`_scoped_memo`: the splits share phases and their estimates
    the plans' dispatch): the schedules are those planned with nothing remembered, and none outlives the batch."""
    pool = [Deployment.parse(t, CLUSTER) for t in CP_POOL]
    ours = PhasedPlanner(BIG_CP.with_policies(True), 16, pool)
    fresh = PhasedPlanner(BIG_CP.with_policies(True), 16, pool)
    monkeypatch.setattr(fresh, "_scoped_memo", contextlib.nullcontext)
    for seed in range(3):
        b = np.concatenate([code_batch(seed), [LONG + 8000] * 2])
        a, want = ours.schedule(b), fresh.schedule(b)
        assert a.iteration_time_s == want.iteration_time_s
        assert [p.replicas for p in a.phases] == [p.replicas for p in want.phases]
    assert ours._memo is None and ours._later is not None and ours._later._memo is None


def test_a_refit_planner_keeps_the_deployments_that_missed_a_batch():
    """The comparison after a run leaves out a homogeneous deployment that could not hold some batch (`missed`);
    an online refit plans with a new cost model from its step on, and a run that forgot the earlier batches
    compared against a deployment it could never have used (the demo once measured 1.02x instead of 1.45x)."""
    from hydraulis.planner.pool import parse_pool

    budgeted = load_cost_model("tiny@cpu-measured").for_job(40 << 20, 4, 64 << 20, False)
    pool = parse_pool("1x(tp2,pp1) + 2x(tp1,pp1); 4x(tp1,pp1)", ClusterSpec(4))
    planner = PhasedPlanner(budgeted, 4, pool)
    planner.schedule(np.array([2000, 100, 200, 300, 50]), 7)  # 4x(tp1,pp1) holds 1,792 tokens at most
    assert planner.missed == {1}
    other = budgeted.with_overlap(False)  # another cost model, as a refit's is
    refit = planner.with_cost(other)
    assert type(refit) is PhasedPlanner and refit.cost is other
    refit.schedule(np.array([100, 200, 300, 50]), 8)  # every deployment holds this one
    assert refit.missed == {1} and set(refit.outlook) == {7, 8}
    assert planner.missed is refit.missed and planner.outlook is refit.outlook


@settings(max_examples=20, deadline=None)
@given(st.lists(st.lists(st.integers(100, 30000), min_size=1, max_size=12), min_size=2, max_size=4))
def test_samples_are_clipped_where_batches_stop_between_their_longest(sample):
    """Between the samples' shortest and longest maxima, at config caps STOP_RATIO apart, each sample longer than
    the level clipped to it: a batch that stops there, with the sample's other sequences."""
    from hydraulis.planner.pool import replicable_configs
    from hydraulis.planner.proposal.phased import STOP_RATIO, _short_batches, stop_levels

    sample = [np.array(b, dtype=np.int64) for b in sample]
    configs = replicable_configs(BIG, CLUSTER)
    tops = [int(b.max()) for b in sample]
    levels = stop_levels(BIG, 16, configs, sample)
    caps = {BIG.cap(g, 16) for g in configs}
    assert all(min(tops) < lv < max(tops) and lv in caps for lv in levels)
    assert all(b >= a * STOP_RATIO for a, b in zip(levels, levels[1:], strict=False))
    for lv in levels:
        clipped = _short_batches(sample, lv, clip=True)
        longer = [b for b in sample if int(b.max()) > lv]
        assert len(clipped) == len(longer) and all(int(c.max()) == lv for c in clipped)
        assert all(np.array_equal(c, np.minimum(b, lv)) for c, b in zip(clipped, longer, strict=True))
