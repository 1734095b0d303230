"""Mixtures: the sampler's mixed order (data/sampler.py `mixed_order`) and the mixed corpus (training/mixture.py)."""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.data.build.corpus import build_corpus
from hydraulis.data.indexed import open_corpus
from hydraulis.data.sampler import Mixture, SamplerState, TokenBudgetSampler, mixed_order
from hydraulis.errors import HydraulisError
from hydraulis.training.mixture import MixedCorpus, source_shares

mixtures = st.tuples(
    st.lists(st.lists(st.integers(1, 60), min_size=1, max_size=30), min_size=1, max_size=4),
    st.data(),
)


def _mixture(sizes: list[list[int]], data: st.DataObject) -> tuple[Mixture, np.ndarray]:
    weights = data.draw(st.lists(st.floats(0.05, 1.0), min_size=len(sizes), max_size=len(sizes)))
    bounds = tuple(int(b) for b in np.cumsum([0] + [len(s) for s in sizes]))
    names = tuple(f"s{i}" for i in range(len(sizes)))
    return Mixture(names, bounds, tuple(weights)), np.concatenate([np.array(s, dtype=np.int64) for s in sizes])


def _epochs(mixture: Mixture, tokens: np.ndarray, seed: int, count: int) -> list[np.ndarray]:
    """Each epoch's document order (whole documents: each its own piece)."""
    docs = np.arange(len(tokens))
    whole = TokenBudgetSampler(tokens, int(tokens.max()), seed=seed).pieces
    return [mixed_order(mixture, docs, whole, seed, e)[0] for e in range(count)]


@settings(max_examples=60, deadline=None)
@given(mixtures, st.integers(0, 2**32 - 1))
def test_the_order_is_a_function_of_seed_and_epoch(case, seed):
    mixture, tokens = _mixture(*case)
    assert all(np.array_equal(a, b) for a, b in zip(_epochs(mixture, tokens, seed, 3),
                                                     _epochs(mixture, tokens, seed, 3), strict=True))  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(mixtures, st.integers(0, 1000))
def test_each_source_is_its_shuffled_passes_in_turn(case, seed):
    """A source's documents over the epochs are whole passes over it, each a permutation: every document once
    before any repeats, none skipped or served twice where an epoch ends."""
    mixture, tokens = _mixture(*case)
    order = np.concatenate(_epochs(mixture, tokens, seed, 4))
    for i in range(len(mixture.names)):
        mine = np.arange(mixture.bounds[i], mixture.bounds[i + 1])
        seq = order[mixture.source_of(order) == i]
        full = len(seq) // len(mine)
        for p in range(full):
            assert sorted(seq[p * len(mine) : (p + 1) * len(mine)].tolist()) == mine.tolist()
        rest = seq[full * len(mine) :]
        assert len(set(rest.tolist())) == len(rest)


@settings(max_examples=60, deadline=None)
@given(mixtures, st.integers(0, 1000))
def test_every_prefix_holds_the_sources_in_proportion(case, seed):
    """Along an epoch's order each source's tokens stay near its weight's share (k sources: within k of the
    longest documents, and k tokens of rounding): the sources are interleaved, not served one after another."""
    mixture, tokens = _mixture(*case)
    longest = int(tokens.max())
    for order in _epochs(mixture, tokens, seed, 2):
        served = tokens[order]
        total = np.cumsum(served)
        for i, w in enumerate(mixture.weights):
            mine = np.cumsum(np.where(mixture.source_of(order) == i, served, 0))
            assert np.all(np.abs(mine - w * total) <= len(mixture.names) * (longest + 1) + 1)


@settings(max_examples=40, deadline=None)
@given(mixtures, st.integers(2, 16), st.integers(0, 1000))
def test_a_split_documents_pieces_are_spread_among_the_other_sources(case, max_len, seed):
    """With max_len, the interleaving is of pieces: a source of long documents does not serve one document's
    pieces in a run while the others wait (every prefix within k pieces of its share, as above)."""
    mixture, tokens = _mixture(*case)
    pieces = TokenBudgetSampler(tokens, 64, max_len=max_len, seed=seed).pieces
    for epoch in range(2):
        docs, _, lengths = mixed_order(mixture, np.arange(len(tokens)), pieces, seed, epoch)
        total = np.cumsum(lengths)
        for i, w in enumerate(mixture.weights):
            mine = np.cumsum(np.where(mixture.source_of(docs) == i, lengths, 0))
            assert np.all(np.abs(mine - w * total) <= len(mixture.names) * (max_len + 1) + 1)


@settings(max_examples=40, deadline=None)
@given(mixtures, st.integers(1, 6))
def test_over_epochs_each_source_serves_its_weight(case, epochs):
    mixture, tokens = _mixture(*case)
    order = np.concatenate(_epochs(mixture, tokens, 5, epochs))
    for i, w in enumerate(mixture.weights):
        mine = tokens[order[mixture.source_of(order) == i]].sum()
        assert abs(mine - epochs * w * tokens.sum()) <= tokens[mixture.bounds[i] : mixture.bounds[i + 1]].max() + 1


def test_the_sampler_draws_the_weights_in_every_stretch_of_batches_and_resumes():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(5, 100, 300), rng.integers(5, 300, 40)])
    mixture = Mixture(("a", "b"), (0, 300, 340), (4.0, 1.0))  # weights normalised: 0.8, 0.2
    sampler = TokenBudgetSampler(lengths, 1000, 200, seed=1, mixture=mixture)
    batches = sampler.batches(50)
    share = sum(b.lengths[b.docs >= 300].sum() for b in batches) / sum(b.num_tokens for b in batches)
    assert share == pytest.approx(0.2, abs=0.01)  # the 40 long documents would be 0.25 unmixed
    assert sampler.tokens_per_epoch() == pytest.approx(lengths.sum(), rel=0.02)  # an epoch: every source's size
    again = TokenBudgetSampler(lengths, 1000, 200, seed=1, mixture=mixture, state=batches[20].state)
    assert [b.docs.tolist() for b in again.batches(30)] == [b.docs.tolist() for b in batches[20:]]


def test_held_out_documents_are_never_drawn_and_an_emptied_source_is_one_line():
    lengths = np.full(20, 10)
    mixture = Mixture(("a", "b"), (0, 10, 20), (1.0, 1.0))
    documents = np.array([0, 1, 2, 10, 11])
    sampler = TokenBudgetSampler(lengths, 40, seed=0, documents=documents, mixture=mixture)
    assert set(np.concatenate([b.docs for b in sampler.batches(10)]).tolist()) == set(documents.tolist())
    with pytest.raises(HydraulisError, match="mixture source b has no document left"):
        TokenBudgetSampler(lengths, 40, seed=0, documents=np.arange(10), mixture=mixture)
    with pytest.raises(HydraulisError, match="weights must be positive"):
        Mixture(("a", "b"), (0, 10, 20), (1.0, 0.0))


def _corpus(path: Path, alphabet: str, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    docs = ["".join(rng.choice(list(alphabet), size=int(n))) for n in rng.integers(3, 60, size=15)]
    build_corpus(docs, path, "bytes", "mixture test", name=path.name)
    return path


def test_the_mixed_corpus_is_its_sources_one_after_another(tmp_path):
    a = open_corpus(_corpus(tmp_path / "letters", string.ascii_lowercase, 0))
    b = open_corpus(_corpus(tmp_path / "digits", string.digits, 1))
    mixed = MixedCorpus((a, b), ("letters", "digits"), (3.0, 1.0))
    assert len(mixed) == len(a) + len(b) and mixed.mixture.weights == (0.75, 0.25)
    assert np.array_equal(mixed[len(a) + 2], b[2]) and np.array_equal(mixed[3], a[3]) and mixed.target_mask(0) is None
    docs, starts, lens = np.array([1, len(a) + 1, len(a) + 4]), np.array([0, 2, 0]), np.array([3, 4, 5])
    assert mixed.piece_targets(docs, starts, lens) == (3 - 1) + (4 - 1) + (5 - 1)
    assert mixed.manifest.documents == len(a) + len(b) and set(mixed.manifest.checksums) >= {"digits/tokens.bin"}
    sampler = TokenBudgetSampler(mixed.lengths, 200, seed=0, mixture=mixed.mixture)
    batch = sampler.next_batch()
    counts = mixed.source_counts(batch)
    assert sum(counts["source_tokens"].values()) == batch.num_tokens
    assert sum(counts["source_targets"].values()) == mixed.piece_targets(batch.docs, batch.starts, batch.lengths)
    shares = source_shares([counts, counts], {"letters": 0.75, "digits": 0.25})
    assert shares["digits"]["tokens"] == 2 * counts["source_tokens"]["digits"]
    assert sum(v["token_share"] for v in shares.values()) == pytest.approx(1.0)


def test_corpora_of_different_tokenizers_do_not_mix(tmp_path):
    a = open_corpus(_corpus(tmp_path / "a", string.ascii_lowercase, 0))
    build_corpus(["some text"] * 3, tmp_path / "g", "gpt2", "gpt2 text", name="g")
    with pytest.raises(HydraulisError, match="tokenized differently"):
        MixedCorpus((a, open_corpus(tmp_path / "g")), ("a", "g"), (1.0, 1.0))


def test_sampler_state_position_is_checked_against_the_mixed_epoch():
    mixture = Mixture(("a",), (0, 5), (1.0,))
    sampler = TokenBudgetSampler(np.full(5, 4), 8, seed=0, mixture=mixture)
    with pytest.raises(HydraulisError, match="past the end"):
        sampler.state = SamplerState(0, 6)


def test_the_pieces_the_planner_sees_follow_the_weights():
    """piece_lengths (what pool = "auto" proposes from and profile = "auto" measures) is the mixture's: short
    documents at weight 0.9 make most pieces short, though the corpus holds as many long ones."""
    lengths = np.concatenate([np.full(50, 10), np.full(50, 200)])
    mixed = TokenBudgetSampler(lengths, 400, seed=0, mixture=Mixture(("s", "l"), (0, 50, 100), (0.9, 0.1)))
    pieces = mixed.piece_lengths()
    assert (pieces == 10).sum() * 10 / pieces.sum() == pytest.approx(0.9, abs=0.02)
    assert np.median(TokenBudgetSampler(lengths, 400, seed=0).piece_lengths()) > 10
