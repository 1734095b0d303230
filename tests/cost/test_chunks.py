"""The chunked-sequence oracle (cost/chunks.py) and the bound that takes chunks (planner/bounds.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.cost.chunks import CHUNK_GRANULARITY, chunk_sizes, chunked_stage_time, kv_share, lone_cap
from hydraulis.cost.model import FORWARD_SHARE
from hydraulis.planner.bounds import lower_bound

COST = load_cost_model("llama-7b@a800-80g+cp")
N = 64
CONFIGS = [g for g in COST.configs if g.num_gpus <= N]


def test_a_chunk_leaves_room_for_the_whole_sequences_keys_and_values():
    lengths = np.array([1024, 200_000, 600_000])
    chunk = chunk_sizes(COST, CONFIGS, N, lengths)
    for i, g in enumerate(CONFIGS):
        cap = lone_cap(COST, g, N)  # a pass of its own: the lone micro-batch's
        for j, s in enumerate(lengths):
            if s <= cap:
                assert chunk[i, j] == s
            elif chunk[i, j]:
                assert chunk[i, j] % CHUNK_GRANULARITY == 0
                assert chunk[i, j] + kv_share(COST, g) * s <= cap
                assert chunk[i, j] + CHUNK_GRANULARITY + kv_share(COST, g) * s > cap  # the largest such


def test_chunks_cost_the_whole_work_the_recompute_of_all_but_the_last_chunk_and_c_each():
    s = 150_000
    g = next(g for g in CONFIGS if g.name == "tp1pp4cp2")
    t = chunked_stage_time(COST, [g], N, np.array([s]))[0, 0]
    chunk, coef = chunk_sizes(COST, [g], N, np.array([s]))[0, 0], COST.coefficients(g)
    k = np.ceil(s / chunk)
    assert 1 < k < s / 1024
    w = COST.cost_matrix(np.array([s, s - chunk]), [g])[0]
    assert np.isclose(t, w[0] + k * coef.c + FORWARD_SHARE * (w[1] + (k - 1) * coef.c), rtol=1e-12)
    assert np.isinf(chunked_stage_time(COST, [g], N, np.array([1024]))[0, 0])  # within the cap: no chunks


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), longest=st.integers(1024, 520_000))
def test_chunks_only_lower_the_bound_and_never_where_every_sequence_fits_a_cheap_cap(seed, longest):
    rng = np.random.default_rng(seed)
    b = np.append(rng.integers(64, 8192, 40), longest)
    assert lower_bound(b, COST, N, chunked=True) <= lower_bound(b, COST, N) * (1 + 1e-12)
    short = b[b <= 8192]
    assert lower_bound(short, COST, N, chunked=True) == lower_bound(short, COST, N)
