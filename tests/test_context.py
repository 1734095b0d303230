"""split_for_cp: every token once, the per-rank bound, short documents whole, zigzag balance."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.context import max_rank_tokens, split_for_cp, zigzag_chunks
from hydraulis.errors import HydraulisError

micro_batches = st.lists(st.integers(1, 400), min_size=1, max_size=24)
degrees = st.sampled_from([1, 2, 3, 4, 8])


def feasible(lengths: list[int], cp: int) -> bool:
    return len(lengths) >= cp or max(lengths) >= 2 * cp


@settings(max_examples=300, deadline=None)
@given(micro_batches, degrees)
def test_every_token_exactly_once_and_bound_holds(lengths, cp):
    s = split_for_cp(lengths, cp)
    for d, n in enumerate(lengths):
        mine = s.doc == d
        covered = np.zeros(n, dtype=np.int64)
        for a, b in zip(s.start[mine], s.stop[mine], strict=True):
            assert 0 <= a < b <= n
            covered[a:b] += 1
        assert (covered == 1).all(), (d, covered)
    tokens = s.rank_tokens()
    assert tokens.sum() == sum(lengths)
    assert tokens.max() <= max_rank_tokens(sum(lengths), cp)
    # Only a micro-batch of fewer than cp documents, all shorter than 2cp, leaves a rank empty.
    assert tokens.min() > 0 or not feasible(lengths, cp)
    # The segments of one rank, in its order, hold its tokens.
    assert sum(int((c - b).sum()) for _, b, c in (s.segments(r) for r in range(cp))) == sum(lengths)


@settings(max_examples=300, deadline=None)
@given(micro_batches, degrees)
def test_short_documents_stay_whole_and_split_ones_zigzag(lengths, cp):
    s = split_for_cp(lengths, cp)
    lengths_arr = np.asarray(lengths)
    assert not s.split[lengths_arr < 2 * cp].any()
    for d in range(len(lengths)):
        rows = np.flatnonzero(s.doc == d)
        if not s.split[d]:
            assert len(rows) == 1 and s.start[rows[0]] == 0 and s.stop[rows[0]] == lengths[d]
            continue
        assert len(rows) == 2 * cp
        order = rows[np.argsort(s.start[rows])]
        # chunk j belongs to rank j for the first half and to rank 2cp - 1 - j for the second
        expected = np.concatenate([np.arange(cp), np.arange(cp)[::-1]])
        assert (s.rank[order] == expected).all()
        sizes = s.stop[order] - s.start[order]
        assert sizes.max() - sizes.min() <= 1
    # Documents are split longest first: no whole document is longer than a split one.
    if s.split.any() and (~s.split).any():
        assert lengths_arr[~s.split].max() <= lengths_arr[s.split].min()


def causal_work(s, d: int) -> np.ndarray:
    """Per rank: query-key pairs of document d under the causal mask (sum of position + 1 over its tokens)."""
    work = np.zeros(s.cp, dtype=np.int64)
    for r, a, b in zip(s.rank[s.doc == d], s.start[s.doc == d], s.stop[s.doc == d], strict=True):
        work[r] += (b * (b + 1) - a * (a + 1)) // 2
    return work


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 8), st.integers(0, 5000))
def test_zigzag_balances_causal_attention(cp, extra):
    n = 16 * cp * cp + extra
    s = split_for_cp([n], cp)
    assert s.split[0]
    work = causal_work(s, 0)
    # Rounding moves at most 2cp tokens between chunks, each worth at most n pairs;
    # a contiguous split would differ by about n^2 / cp between the first and the last rank.
    assert work.max() - work.min() <= 2 * cp * n
    contiguous = np.diff(np.linspace(0, n, cp + 1).astype(np.int64) ** 2) // 2
    assert contiguous.max() - contiguous.min() > 2 * cp * n


def test_long_document_split_short_ones_whole():
    s = split_for_cp([400, 7, 3, 12], 4)
    assert s.split.tolist() == [True, False, False, False]
    assert s.rank_tokens().max() <= max_rank_tokens(422, 4)


def test_balanced_whole_documents_are_not_split():
    s = split_for_cp([50, 50, 50, 50], 4)
    assert not s.split.any()
    assert sorted(s.rank.tolist()) == [0, 1, 2, 3]


def test_tiny_micro_batch_leaves_ranks_empty_rather_than_fail():
    s = split_for_cp([3, 1], 4)
    assert not s.split.any() and sorted(s.rank_tokens().tolist()) == [0, 0, 1, 3]


def test_cp1_keeps_everything_on_one_rank():
    s = split_for_cp([5, 9], 1)
    assert not s.split.any() and s.rank_tokens().tolist() == [14]


def test_zigzag_chunks_give_extras_in_order():
    # base 2, 3 extra: chunks 1 and 0 (first chunks of ranks 1 and 0), then chunk 2 (rank 1's second)
    bounds = zigzag_chunks(11, 2, np.array([1, 0]))
    assert np.diff(bounds).tolist() == [3, 3, 3, 2]


@pytest.mark.parametrize(
    ("lengths", "cp", "message"),
    [
        ([], 2, r"at least one document"),
        ([4, 0], 2, r"document 1 is empty"),
        ([4], 0, r"cp=0"),
    ],
)
def test_bad_input_is_one_line(lengths, cp, message):
    with pytest.raises(HydraulisError, match=message) as info:
        split_for_cp(lengths, cp)
    assert "\n" not in str(info.value)
