"""The micro-batch count rule of interleaved replicas: the planner runs only counts whose Megatron group is pp, and
a replica's cap is the least over those counts, which the memory model at the chosen count confirms."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.cost.activations import grouped_count, grouped_counts, in_flight
from hydraulis.parallel import ParallelConfig, interleave_group
from hydraulis.planner.packing import pack_replica
from hydraulis.planner.replicas import ReplicaCost, allowed_counts

COST = load_cost_model("llama-70b@h100-80g+cp").with_interleaving()


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 8), st.integers(2, 5), st.integers(1, 40))
def test_an_allowed_count_has_group_pp_and_holds_no_more_than_the_grouped_counts(pp, vp, m):
    config = ParallelConfig(1, pp, 1, vp)
    assert grouped_count(pp, 1, m)  # 1F1B: any count
    if not grouped_count(pp, vp, m):
        assert interleave_group(pp, m) > pp
        return
    assert interleave_group(pp, m) == min(pp, m)
    for stage in range(pp):
        assert in_flight(config, stage, m) <= max(in_flight(config, stage, g) for g in grouped_counts(pp))


@pytest.mark.parametrize("config", [ParallelConfig(1, 8, 8, 5), ParallelConfig(4, 8, 1, 5), ParallelConfig(2, 4, 2, 2)])
def test_the_grouped_cap_holds_at_every_allowed_count_and_beats_the_any_count_cap(config):
    """llama-70b h100 tp1pp8cp8vp5 at 128 GPUs: 5,504 tokens at the worst count (15), 8,320 at M = 16, 24, 32."""
    replica = ReplicaCost.of(COST, config, 128)
    allowed = [m for m in range(2, 4 * config.pp + 1) if grouped_count(config.pp, config.vp, m)]
    assert all(replica.cap <= COST.micro_batch_cap(config, 128, m) for m in allowed)
    assert replica.cap == min(COST.micro_batch_cap(config, 128, m) for m in allowed)
    assert replica.cap > COST.cap(config, 128)  # the cap for any count, the baselines' (M in (pp, 2 pp) binds)
    assert COST.cap(config, 128) == min(COST.micro_batch_cap(config, 128, m) for m in range(2, 4 * config.pp + 1))
    if config == ParallelConfig(1, 8, 8, 5):
        assert (COST.cap(config, 128), replica.cap) == (5504, 8320)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4000), min_size=1, max_size=60), st.integers(0, 2**31 - 1),
       st.sampled_from([ParallelConfig(1, 8, 8, 5), ParallelConfig(2, 4, 2, 2), ParallelConfig(4, 8, 1, 5)]))
def test_a_re_cut_packing_keeps_every_sequence_once_at_an_allowed_count_within_the_cap(lengths, seed, config):
    replica = ReplicaCost.of(COST, config, 128)
    lengths = np.minimum(np.array(lengths), replica.cap)
    rng = np.random.default_rng(seed)
    bins = rng.integers(0, rng.integers(1, len(lengths) + 1), size=len(lengths))
    mbs = [np.flatnonzero(bins == b) for b in np.unique(bins)]
    mbs = [mb for mb in mbs if lengths[mb].sum() <= replica.cap] or [np.array([0])]
    recut = allowed_counts(mbs, lengths, replica)
    if recut is None:  # neither split nor merged to a multiple of pp: the count was not allowed
        assert not grouped_count(config.pp, config.vp, len(mbs))
        return
    assert grouped_count(config.pp, config.vp, len(recut)) and all(len(mb) for mb in recut)
    assert sorted(np.concatenate(recut).tolist()) == sorted(np.concatenate(mbs).tolist())
    assert max(int(lengths[mb].sum()) for mb in recut) <= replica.cap


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(64, 9000), min_size=1, max_size=40),
       st.sampled_from([ParallelConfig(1, 8, 8, 5), ParallelConfig(4, 8, 1, 5), ParallelConfig(1, 8, 8, 1)]))
def test_every_packing_of_an_interleaved_replica_runs_an_allowed_count_within_that_counts_cap(lengths, config):
    replica = ReplicaCost.of(COST, config, 128)
    lengths = np.minimum(np.array(lengths), replica.cap)
    packing = pack_replica(np.arange(len(lengths)), lengths, replica, COST)
    m = len(packing.micro_batches)
    assert grouped_count(config.pp, config.vp, m)
    assert sorted(np.concatenate(packing.micro_batches).tolist()) == list(range(len(lengths)))
    cap = COST.micro_batch_cap(config, 128, m)  # the memory model at the chosen count
    assert all(int(lengths[mb].sum()) <= cap for mb in packing.micro_batches)
