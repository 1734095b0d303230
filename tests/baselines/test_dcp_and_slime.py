"""megatron-dcp and slime-flops do what Megatron-LM's and slime's schedulers do (docs/design.md, section 5)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hydraulis.baselines.dynamic_cp import DynamicCP
from hydraulis.baselines.homogeneous import karmarkar_karp
from hydraulis.baselines.slime import SlimeFlops, forward_flops, split_by_tokens
from hydraulis.cost import load_cost_model
from hydraulis.parallel import ParallelConfig
from hydraulis.planner.policy import PolicyContext
from hydraulis.planner.schedule import check_schedule
from hydraulis.specs import MODELS, ClusterSpec

COST = load_cost_model("llama-7b@a800-80g")
CLUSTER = ClusterSpec(16)


def code_batch(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(7.5, 1.2, 60).astype(np.int64) + 16, 60_000)


def dcp(batches: list[np.ndarray], base: ParallelConfig | None = None) -> DynamicCP:
    return DynamicCP(PolicyContext.build(COST, CLUSTER, batches), base)


def test_dcp_groups_every_micro_batch_over_all_ranks_in_power_of_two_cp_sizes():
    b = code_batch(0)
    policy = dcp([b], ParallelConfig(2, 1))
    assert policy.ranks == 8 and policy.budget == COST.cap(ParallelConfig(2, 1), 16)
    seen = []
    for mb in policy.micro_batches(b):
        ranks = sorted(r for g in mb.groups for r in range(g.first, g.first + g.size))
        assert ranks == list(range(8))  # no rank idle, none in two groups
        for g in mb.groups:
            assert g.size & (g.size - 1) == 0  # 1, 2, 4 or 8
            assert g.tokens / g.size <= policy.budget and g.tokens <= policy.caps[g.size]
            # A sequence runs on at least as many ranks as its tokens per rank need.
            assert all(g.size >= 2 ** math.ceil(math.log2(max(b[i] / policy.budget, 1))) for i in g.members)
            seen += g.members
    assert sorted(seen) == list(range(len(b)))
    assert any(g.size > 1 for mb in policy.micro_batches(b) for g in mb.groups)  # 60K documents need CP


def test_dcp_packs_the_longest_first_and_balances_the_first_micro_batch():
    policy = dcp([code_batch(1)], ParallelConfig(2, 1))
    b = np.array([40_000, 30_000, 9_000, 8_000, 7_000, 6_000, 500, 400])
    first = policy.micro_batches(b)[0]
    assert 0 in first.groups[0].members and first.groups[0].size == 4  # 40K over an 18K budget: 4 ranks


def test_dcp_schedule_is_valid_and_timed_as_its_micro_batches_run():
    batches = [code_batch(s) for s in range(3)]
    policy = dcp(batches)
    for step, b in enumerate(batches):
        schedule = policy.schedule(b, step)
        check_schedule(schedule, policy.cost)
        longest = max(p.predicted_time_s for p in schedule.phases)
        assert schedule.iteration_time_s >= longest - 1e-12  # micro-batches follow each other on shared ranks


def test_slime_forward_flops_by_hand():
    m = MODELS["tiny"]
    s = np.array([1, 10, 100])
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    per_layer = 2 * s * m.hidden * q + 4 * s * m.hidden * kv + 2 * s * q * m.hidden + 6 * s * m.hidden * m.ffn
    attention = 2 * m.heads * m.head_dim * s * s
    head = 2 * s * m.hidden * m.vocab_rows
    np.testing.assert_allclose(forward_flops(m, s), m.layers * (per_layer + attention) + head, rtol=1e-12)


def test_slime_packs_by_flops_then_deals_equal_counts_to_the_ranks():
    b = code_batch(3)
    ctx = PolicyContext.build(COST, CLUSTER, [b])
    policy = SlimeFlops(ctx)
    schedule = policy.schedule(b, 0)
    check_schedule(schedule, COST)
    plan = schedule.phases[0]
    counts = [len(r.micro_batches) for r in plan.replicas]
    assert max(counts) - min(counts) <= 1 or min(counts) == 0
    bins = policy.micro_batches(b, forward_flops(COST.model, b))
    assert len(bins) >= math.ceil(b.sum() / policy.cap)
    assert all(b[x].sum() <= policy.cap for x in bins)


def test_split_by_tokens_goes_longest_first_to_the_lighter_half():
    """By hand: 10 left; 9 right; 8 right (9 < 10); the 1s left (10 < 17, then 11 < 17)."""
    assert split_by_tokens([0, 1, 2, 3, 4], np.array([10, 9, 8, 1, 1])) == ([0, 3, 4], [1, 2])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(weights=st.lists(st.floats(0, 1e6), min_size=1, max_size=40), k=st.integers(1, 6))
def test_equal_size_karmarkar_karp_deals_equal_counts(weights, k):
    w = np.array(weights[: len(weights) // k * k] or [1.0] * k)
    parts = karmarkar_karp(w, k, equal_size=True)
    assert sorted(i for p in parts for i in p) == list(range(len(w)))
    assert {len(p) for p in parts} == {len(w) // k}


def test_equal_size_needs_a_multiple():
    from hydraulis.errors import HydraulisError

    with pytest.raises(HydraulisError, match="equal-size"):
        karmarkar_karp(np.ones(5), 2, equal_size=True)
