from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.planner.proposal.range_dp import LengthHistogram, aware_group_time, published_group_time, range_dp

COST = load_cost_model("llama-7b@a800-80g")


def _setup(lengths, num_gpus):
    hist = LengthHistogram.from_batches([np.asarray(lengths)])
    configs = [c for c in COST.configs if c.num_gpus <= num_gpus and COST.cap(c, num_gpus) > 0]
    caps = sorted({COST.cap(c, num_gpus) for c in configs if COST.cap(c, num_gpus) < hist.max_length})
    return hist, configs, caps + [hist.max_length]


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(16, 60000), min_size=1, max_size=60),
    st.sampled_from([8, 16, 32, 64]),
    st.booleans(),
)
def test_groups_cover_lengths_within_caps_and_gpus(lengths, num_gpus, aware):
    hist, configs, bounds = _setup(lengths, num_gpus)
    gt = aware_group_time(COST, configs, hist, num_gpus) if aware else published_group_time(COST, configs, hist)
    for max_length, time, groups in range_dp(COST, num_gpus, hist, configs, gt, bounds):
        assert groups[0].lo == 0 and groups[-1].hi == max_length
        for g0, g1 in itertools.pairwise(groups):
            assert g0.hi == g1.lo
        assert all(COST.lone_cap(g.config, num_gpus) >= g.hi for g in groups)  # the longest each holds
        assert sum(g.replicas * g.config.num_gpus for g in groups) <= num_gpus
        assert time >= 0


def test_single_range_published_is_best_homogeneous():
    lengths = [1000, 2000, 3000, 4000]
    hist, configs, _ = _setup(lengths, 16)
    gt = published_group_time(COST, configs, hist)
    ((_, time, groups),) = range_dp(COST, 16, hist, configs, gt, [4000])
    work = {c: float(COST.seq_costs(c, np.array(lengths)).sum()) for c in configs}
    expected = min(work[c] / (16 // c.num_gpus) for c in configs)
    assert time == pytest.approx(expected)
    assert len(groups) >= 1


def test_long_sequence_gets_a_config_that_holds_it():
    lengths = [200] * 500 + [60000]
    hist, configs, bounds = _setup(lengths, 32)
    results = range_dp(COST, 32, hist, configs, aware_group_time(COST, configs, hist, 32), bounds)
    _, _, groups = results[-1]
    assert COST.cap(groups[-1].config, 32) >= 60000
