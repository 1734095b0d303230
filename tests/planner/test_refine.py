"""The proposal's candidates beyond their fixed shapes: homogeneous CP deployments and the local search from the
candidate planned fastest (`proposal/refine.py`), on the bench's own batches."""

from __future__ import annotations

import numpy as np

from hydraulis.bench import get_scenarios
from hydraulis.cost import load_cost_model
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.planner import Planner
from hydraulis.planner.pool import candidate_deployments
from hydraulis.planner.proposal.refine import neighbours, refine
from hydraulis.planner.proposal.screen import plan_times
from hydraulis.specs import ClusterSpec


def scenario(name: str):
    s = get_scenarios([name])[0]
    sample = s.sample(s.seed + 1000, 4)
    return load_cost_model(s.profile).with_policies(True), ClusterSpec(s.num_gpus), sample


def test_neighbours_move_gpus_between_configs_and_keep_the_longest_sequence_held():
    cost, cluster, _ = scenario("7b-32g-code-256k-32k")
    start = Deployment.parse("4x(tp2,pp1,cp4)", cluster)
    fills = [ParallelConfig(2, 1), ParallelConfig(4, 1)]
    found = {str(d): d for d in neighbours(cost, cluster, start, fills, 32768)}
    assert "3x(tp2,pp1,cp4) + 4x(tp2,pp1)" in found  # one replica's GPUs to another config
    assert "16x(tp2,pp1)" in found  # the whole group's GPUs to tp2pp1 (under recompute it holds 32K alone)
    mixed = Deployment.parse("3x(tp2,pp1,cp4) + 4x(tp2,pp1)", cluster)
    back = {str(d) for d in neighbours(cost, cluster, mixed, fills, 32768)}
    assert "2x(tp2,pp1,cp4) + 8x(tp2,pp1)" in back  # a replica between groups
    assert "3x(tp2,pp1,cp4) + 2x(tp4,pp1)" in back  # a group's GPUs to another config
    for d in found.values():
        d.validate(cluster)
        assert max(cost.lone_cap(g, 32) for g in d.configs) >= 32768


def test_refine_plans_a_mix_the_fixed_shapes_miss_and_never_loses():
    """7b-32g-code: from 4x tp2pp1cp4 (the best homogeneous) the search finds three of them beside tp2pp1
    replicas, which the candidates' shapes (CP large replicas beside the best small configs alone) lack."""
    cost, cluster, sample = scenario("7b-32g-code-256k-32k")
    start = [Deployment.parse("4x(tp2,pp1,cp4)", cluster)]
    times = plan_times(cost, cluster, start, sample, None)
    found, rows = refine(cost, cluster, start, times, sample, 32768, budget=40)
    assert rows.shape == (len(found), len(sample)) and str(found[0]) == str(start[0])
    best = int(np.argmin(rows.sum(axis=1)))
    assert rows[best].sum() < 0.98 * times[0].sum()
    assert ParallelConfig(2, 1, 4) in found[best].configs and not found[best].is_homogeneous


def test_homogeneous_cp_deployments_are_candidates():
    """7b-32g-wikisample: 8x tp2pp1cp2 plans 3% faster than 16x tp2pp1 (fewer, larger replicas balance many
    short documents better and pay c less often), though tp2pp1cp2 runs the longest sequence no faster than
    a plain config, so it takes no large role."""
    cost, cluster, sample = scenario("7b-32g-wikisample-512k-16k")
    longest = max(int(b.max()) for b in sample)
    texts = {str(d) for d in candidate_deployments(cost, cluster, longest, sample)}
    assert "8x(tp2,pp1,cp2)" in texts


def test_the_samples_plans_go_to_the_memo_as_planned_without_it():
    """`plan_times` with a memo: the same times as without, and a planner of a pool holding a candidate finds each
    sample's plan on it there (the phases' greedy plans the samples whole again) without packing it anew."""
    cost, cluster, sample = scenario("7b-32g-code-256k-32k")
    longest = max(int(b.max()) for b in sample)
    candidates = candidate_deployments(cost, cluster, longest, sample)[:3]
    memo: dict = {}
    times = plan_times(cost, cluster, candidates, sample, None, memo=memo)
    assert np.array_equal(times, plan_times(cost, cluster, candidates, sample, None))
    for k, d in enumerate(candidates):
        planner = Planner(cost, cluster.num_gpus, [d], memo=memo)
        for j, b in enumerate(sample):
            kept = len(memo)
            assert planner.plan(b).predicted_time_s == times[k, j] and len(memo) == kept
