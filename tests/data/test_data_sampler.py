from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.data.sampler import GlobalBatch, SamplerState, TokenBudgetSampler
from hydraulis.errors import HydraulisError


def long_tailed(n: int = 500, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(6.0, 1.5, size=n).astype(np.int64))


def as_lists(batches: list[GlobalBatch]) -> list[tuple[list[int], list[int], list[int]]]:
    return [(b.docs.tolist(), b.starts.tolist(), b.lengths.tolist()) for b in batches]


def test_same_seed_same_batches_on_every_rank() -> None:
    lengths = long_tailed()
    ranks = [TokenBudgetSampler(lengths, 16384, max_len=4096, seed=7) for _ in range(4)]
    drawn = [as_lists(r.batches(20)) for r in ranks]
    assert all(d == drawn[0] for d in drawn)
    other = TokenBudgetSampler(lengths, 16384, max_len=4096, seed=8).batches(20)
    assert as_lists(other) != drawn[0]


def test_batches_respect_the_budget_and_are_full() -> None:
    lengths = long_tailed()
    sampler = TokenBudgetSampler(lengths, 16384, max_len=4096, seed=1)
    batches = sampler.batches(60)  # several epochs
    for b, nxt in zip(batches, batches[1:], strict=False):
        assert 0 < b.num_tokens <= 16384
        assert b.lengths.max() <= 4096
        # full: the next batch's first piece would not have fitted
        assert b.num_tokens + int(nxt.lengths[0]) > 16384
        assert b.next_state == nxt.state


def test_resume_from_state_continues_identically() -> None:
    lengths = long_tailed()
    straight = TokenBudgetSampler(lengths, 16384, max_len=4096, seed=3).batches(40)
    first = TokenBudgetSampler(lengths, 16384, max_len=4096, seed=3)
    first.batches(17)
    saved = SamplerState.from_dict(first.state.to_dict())
    resumed = TokenBudgetSampler(lengths, 16384, max_len=4096, seed=3, state=saved)
    assert as_lists(resumed.batches(23)) == as_lists(straight[17:])
    assert straight[17].state == saved


def test_split_covers_every_token_once_per_epoch() -> None:
    lengths = long_tailed()
    sampler = TokenBudgetSampler(lengths, 8192, max_len=1000, seed=2, cross_epochs=False)
    pieces: dict[int, list[tuple[int, int]]] = {}
    while sampler.state.epoch == 0:
        b = sampler.next_batch()
        assert b.state.epoch == 0
        for d, s, n in zip(b.docs.tolist(), b.starts.tolist(), b.lengths.tolist(), strict=True):
            pieces.setdefault(d, []).append((s, n))
    assert sorted(pieces) == list(range(len(lengths)))
    for d, parts in pieces.items():
        assert parts[0][0] == 0
        assert all(s0 + n0 == s1 for (s0, n0), (s1, _) in zip(parts, parts[1:], strict=False))
        assert sum(n for _, n in parts) == lengths[d]
        assert all(n <= 1000 for _, n in parts)
    assert sampler.state == SamplerState(1, 0)


def test_epoch_boundary_without_crossing_gives_a_short_last_batch() -> None:
    lengths = np.full(10, 100)
    sampler = TokenBudgetSampler(lengths, 300, seed=0, cross_epochs=False)
    sizes = [b.num_tokens for b in sampler.batches(8)]
    assert sizes == [300, 300, 300, 100, 300, 300, 300, 100]
    crossing = TokenBudgetSampler(lengths, 300, seed=0)
    batches = crossing.batches(4)
    assert [b.num_tokens for b in batches] == [300] * 4
    assert batches[3].state == SamplerState(0, 9) and batches[3].next_state == SamplerState(1, 2)


def test_each_epoch_has_its_own_order() -> None:
    sampler = TokenBudgetSampler(np.full(50, 10), 100, seed=0)
    assert sampler.order(0).tolist() != sampler.order(1).tolist()
    assert sorted(sampler.order(1).tolist()) == list(range(50))
    assert TokenBudgetSampler(np.full(5, 10), 100, shuffle=False).order(3).tolist() == [0, 1, 2, 3, 4]


def test_truncate_and_drop_policies() -> None:
    lengths = np.array([50, 500, 70, 1200, 30])
    one_epoch = dict(seed=0, cross_epochs=False)
    trunc = TokenBudgetSampler(lengths, 2000, max_len=100, policy="truncate", **one_epoch).next_batch()
    assert sorted(zip(trunc.docs.tolist(), trunc.lengths.tolist(), strict=True)) == [
        (0, 50),
        (1, 100),
        (2, 70),
        (3, 100),
        (4, 30),
    ]
    assert trunc.starts.tolist() == [0] * 5
    drop = TokenBudgetSampler(lengths, 2000, max_len=100, policy="drop", **one_epoch)
    assert sorted(drop.next_batch().docs.tolist()) == [0, 2, 4]
    assert drop.tokens_per_epoch() == 150
    split = TokenBudgetSampler(lengths, 2000, max_len=100, policy="split", **one_epoch)
    assert split.pieces_per_epoch() == 1 + 5 + 1 + 12 + 1
    assert split.tokens_per_epoch() == int(lengths.sum())


def test_pieces_fetch_tokens_from_a_corpus() -> None:
    docs = [np.arange(n) + 1000 * i for i, n in enumerate([5, 12, 3])]
    sampler = TokenBudgetSampler([5, 12, 3], 20, max_len=5, seed=0)
    for batch in sampler.batches(3):
        for (d, s, n), tokens in zip(
            zip(batch.docs, batch.starts, batch.lengths, strict=True), batch.tokens(docs), strict=True
        ):
            assert tokens.tolist() == docs[d][s : s + n].tolist()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lengths=[10, 20], tokens_per_batch=0), "tokens per batch must be between 1 and"),
        (dict(lengths=[], tokens_per_batch=100), "at least one document"),
        (dict(lengths=[10, 0], tokens_per_batch=100), "must be positive"),
        (dict(lengths=[10, 20], tokens_per_batch=100, max_len=200), "above the batch budget"),
        (dict(lengths=[10, 2000], tokens_per_batch=100), "set max_len with a policy"),
        (dict(lengths=[10, 20], tokens_per_batch=100, max_len=50, policy="wrap"), "unknown over-long policy"),
        (dict(lengths=[60, 70], tokens_per_batch=100, max_len=50, policy="drop"), "leaves nothing"),
        (dict(lengths=[10, 20], tokens_per_batch=100, state=SamplerState(0, 3)), "past the end of epoch 0"),
        (dict(lengths=[10, 20], tokens_per_batch=100, seed=-1), "seed must be between 0 and"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(HydraulisError, match=message):
        TokenBudgetSampler(**kwargs)


def test_bad_state_dict() -> None:
    with pytest.raises(HydraulisError, match="'epoch' and 'position'"):
        SamplerState.from_dict({"epoch": 1})
    with pytest.raises(HydraulisError, match="non-negative integer"):
        SamplerState.from_dict({"epoch": 1, "position": -2})


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=40),
    budget=st.integers(1, 4000),
    max_len=st.integers(1, 4000),
    policy=st.sampled_from(["split", "truncate", "drop"]),
    seed=st.integers(0, 2**32 - 1),
    cross=st.booleans(),
    cut=st.integers(0, 11),
)
def test_invariants(lengths, budget, max_len, policy, seed, cross, cut) -> None:  # noqa: ANN001
    max_len = min(max_len, budget)
    if policy == "drop" and not any(n <= max_len for n in lengths):
        return
    make = lambda state=SamplerState(): TokenBudgetSampler(  # noqa: E731
        lengths, budget, max_len=max_len, seed=seed, policy=policy, cross_epochs=cross, state=state
    )
    straight = make().batches(12)
    for b in straight:
        assert len(b) >= 1 and b.num_tokens <= budget and b.lengths.max() <= max_len
        assert np.all(b.lengths >= 1) and np.all(b.starts + b.lengths <= np.asarray(lengths)[b.docs])
    assert as_lists(make(straight[cut].state).batches(12 - cut)) == as_lists(straight[cut:])


@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    max_len=st.integers(2, 120),
    data=st.data(),
)
@settings(max_examples=150, deadline=None)
def test_truncate_keeps_targets_and_overlong_counts_what_is_cut(lengths, max_len, data) -> None:  # noqa: ANN001
    """Each SFT record given by its first target: a truncated one keeps a window of max_len inside it that
    still holds that first target (or ends at the record's end), and `overlong` counts, for plain
    documents (every token but a piece's first is a target), exactly what each policy loses."""
    lens = np.asarray(lengths)
    first = np.asarray([data.draw(st.integers(1, n)) for n in lengths])  # n: no target at all
    sampler = TokenBudgetSampler(lens, 400, max_len, policy="truncate", first_targets=first)
    docs, starts, cut = sampler.pieces(np.arange(len(lens)))
    assert (cut == np.minimum(lens, max_len)).all() and (starts >= 0).all() and (starts + cut <= lens).all()
    long = lens > max_len
    holds = (starts < first) & (first < starts + cut)
    assert (holds | (starts + cut == lens) | ~long).all()
    assert (starts[~long] == 0).all()
    plain = lambda d, s, n: int(np.maximum(np.asarray(n) - 1, 0).sum())  # noqa: E731
    total = int((lens - 1).sum())
    expected = {  # tokens lost per over-long document of length n
        "split": lambda n: -(-n // max_len) - 1,
        "truncate": lambda n: n - max_len,
        "drop": lambda n: n - 1,
    }
    for policy, lost in expected.items():
        if policy == "drop" and long.all():
            continue  # refused: nothing would be left
        report = TokenBudgetSampler(lens, 400, max_len, policy=policy).overlong(plain, total)
        want = sum(lost(int(n)) for n in lens[long])
        assert (report.records, report.targets_lost, report.targets_kept) == (int(long.sum()), want, total - want)
        assert report.to_dict()[{"split": "split", "truncate": "truncated", "drop": "dropped"}[policy]] == long.sum()
