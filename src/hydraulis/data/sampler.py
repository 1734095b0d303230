"""The token-budget sampler: global batches of whole documents filled to a token budget.

Hydraulis plans per global batch, and a global batch is a token budget (e.g.
256K tokens), not a count of sequences: that is what keeps the work per
iteration comparable when lengths vary by 1000x.

- Every epoch visits each document once, in an order shuffled by
  (seed, epoch) only, so every rank computes the same global batches without
  communicating.
- A document longer than `max_len` follows the policy: `split` into
  consecutive pieces of at most max_len (default; no token is lost),
  `truncate` to max_len tokens, or `drop`. `truncate` keeps a plain
  document's first max_len tokens; an SFT record (`first_targets`: where its
  targets begin) loses its prompt first, from the start: the window ends at
  the record's end when the completion fits in it (with a token of context
  before it), else it starts at the token before the first target and the
  completion's end is cut. So a truncated record always keeps targets.
- `overlong` counts what the policy does: records split, truncated or
  dropped, and the target tokens they lose (a split piece's first token is
  no target: nothing precedes it in its sequence).
- The state is (epoch, position): position counts the pieces of the epoch's
  order already handed out. Restoring a state continues with exactly the
  batches an uninterrupted run would have produced.
- At an epoch's end a batch continues into the next epoch's order by default,
  so every batch is filled; with `cross_epochs=False` an epoch's last batch is
  short instead and no batch mixes two epochs.
- A `Mixture` (sources as ranges of the documents, with weights) replaces the
  epoch's order by `mixed_order`: an epoch serves as many tokens as all the
  sources hold, each source its weight's share of them, read from its own
  endless stream of shuffled passes over its documents (every document once
  before any repeats), and the sources' pieces are interleaved by each one's
  position in its source's share, so every batch holds them in proportion.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from hydraulis.errors import HydraulisError
from hydraulis.limits import MAX_LENGTH, MAX_SEED, MAX_TOKENS_PER_BATCH, check_batch_size, check_int

MAX_EPOCHS_PER_BATCH = 65536

Policy = Literal["split", "truncate", "drop"]
POLICIES: tuple[str, ...] = ("split", "truncate", "drop")
_DONE = {"split": "split", "truncate": "truncated", "drop": "dropped"}  # what each policy did to a record


def split_pieces(lengths: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split each length into consecutive pieces of max_len, the last holding the rest.

    Returns the pieces per document, each piece's start within its document and each piece's length.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n_pieces = -(-lengths // max_len)
    first = np.repeat(_cumsum(n_pieces)[:-1], n_pieces)
    starts = (np.arange(int(n_pieces.sum())) - first) * max_len  # piece number within its document x max_len
    return n_pieces, starts, np.minimum(max_len, np.repeat(lengths, n_pieces) - starts)


@dataclass(frozen=True)
class Overlong:
    """What the over-long policy does to a corpus: records cut (by `policy`) and target tokens lost and kept."""

    max_len: int
    policy: str
    records: int  # documents longer than max_len, each split, truncated or dropped
    pieces: int  # the pieces they become (split: more than `records`; truncate: as many; drop: none)
    targets_lost: int
    targets_kept: int

    @property
    def counts(self) -> dict[str, int]:
        """split / truncated / dropped: the records each policy cut (only this one's is non-zero)."""
        return {word: self.records if self.policy == p else 0 for p, word in _DONE.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"max_len": self.max_len, "policy": self.policy, **self.counts, "pieces": self.pieces,
                "target_tokens_lost": self.targets_lost, "target_tokens_kept": self.targets_kept}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Overlong:
        records = data["split"] + data["truncated"] + data["dropped"]
        return cls(
            max_len=data["max_len"], policy=data["policy"], records=records, pieces=data["pieces"],
            targets_lost=data["target_tokens_lost"], targets_kept=data["target_tokens_kept"],
        )

    def describe(self) -> str:
        """One line: how many records the policy cut, and the target tokens that cost."""
        cut = f"{self.records:,} record(s) longer than max_len {self.max_len:,} {_DONE[self.policy]}"
        if self.policy == "split":
            cut += f" into {self.pieces:,} pieces"
        lost = self.targets_lost + self.targets_kept
        share = f" ({self.targets_lost / lost:.1%})" if lost else ""
        return f"{cut}; {self.targets_lost:,} of {lost:,} target tokens lost{share}"


@dataclass(frozen=True)
class SamplerState:
    """Where the sampler is: the next batch starts at piece `position` of epoch `epoch`'s order."""

    epoch: int = 0
    position: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    @classmethod
    def from_dict(cls, data: dict) -> SamplerState:
        try:
            epoch, position = data["epoch"], data["position"]
        except (KeyError, TypeError):
            raise HydraulisError(f"sampler state needs 'epoch' and 'position', got {data!r}") from None
        for key, v in (("epoch", epoch), ("position", position)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise HydraulisError(f"sampler state {key} must be a non-negative integer, got {v!r}")
        return cls(epoch, position)


@dataclass(frozen=True)
class GlobalBatch:
    """One global batch: piece i is tokens [starts[i], starts[i] + lengths[i]) of document docs[i]."""

    docs: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    state: SamplerState  # where this batch started
    next_state: SamplerState  # where the next one starts

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return len(self.lengths)

    def tokens(self, corpus: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The pieces' tokens from an indexed corpus (each an O(1) memory-map slice)."""
        return [
            corpus[int(d)][int(s) : int(s) + int(n)]
            for d, s, n in zip(self.docs, self.starts, self.lengths, strict=True)
        ]


@dataclass(frozen=True)
class _Epoch:
    docs: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    cumsum: np.ndarray  # cumsum[i] = tokens in pieces [0, i)


class TokenBudgetSampler:
    """Deterministic, resumable global batches over document lengths (see the module docstring)."""

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        tokens_per_batch: int,
        max_len: int | None = None,
        seed: int = 0,
        policy: Policy = "split",
        state: SamplerState = SamplerState(),
        cross_epochs: bool = True,
        shuffle: bool = True,
        first_targets: np.ndarray | None = None,
        documents: np.ndarray | None = None,
        mixture: Mixture | None = None,
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.mixture = mixture
        if mixture is not None and mixture.bounds[-1] != len(self.lengths):
            raise HydraulisError(f"the mixture's sources hold {mixture.bounds[-1]} documents, not {len(self.lengths)}")
        # The documents it draws from (indices into `lengths`): all of them, or those evaluation left to training.
        self.documents = None if documents is None else np.asarray(documents, dtype=np.int64)
        if self.documents is not None and (len(self.documents) == 0 or np.any(self.documents >= len(self.lengths))):
            raise HydraulisError(f"the sampler's documents must be 1 or more of the corpus's {len(self.lengths)}")
        # Per document, the position of its first target (SFT); read by `truncate` for over-long documents.
        self.first_targets = None if first_targets is None else np.asarray(first_targets, dtype=np.int64)
        if self.lengths.ndim != 1 or len(self.lengths) == 0:
            raise HydraulisError("the sampler needs at least one document length")
        if np.any(self.lengths < 1):
            raise HydraulisError("document lengths must be positive")
        check_int(tokens_per_batch, "tokens per batch", 1, MAX_TOKENS_PER_BATCH)
        if max_len is not None:
            check_int(max_len, "max_len", 1, MAX_LENGTH)
        if max_len is not None and max_len > tokens_per_batch:
            raise HydraulisError(
                f"max_len {max_len} is above the batch budget of {tokens_per_batch} tokens; "
                "a sequence could never fit in a batch"
            )
        if max_len is None and int(self.lengths.max()) > tokens_per_batch:
            raise HydraulisError(
                f"the longest document has {int(self.lengths.max())} tokens, above the batch budget of "
                f"{tokens_per_batch}; set max_len with a policy (split, truncate, drop)"
            )
        if policy not in POLICIES:
            raise HydraulisError(f"unknown over-long policy {policy!r}; choose one of: {', '.join(POLICIES)}")
        if max_len is not None and policy == "drop" and not np.any(self.lengths <= max_len):
            raise HydraulisError(f"every document is longer than max_len {max_len}; policy 'drop' leaves nothing")
        check_int(seed, "seed", 0, MAX_SEED)
        self.tokens_per_batch = int(tokens_per_batch)
        self.max_len = max_len
        self.seed = int(seed)
        self.policy = policy
        self.cross_epochs = cross_epochs
        self.shuffle = shuffle
        self._epoch_cache: tuple[int, _Epoch] | None = None
        self._state = SamplerState()
        self.state = state
        self._check_batch_size()

    def _check_batch_size(self) -> None:
        """A batch spans at most MAX_EPOCHS_PER_BATCH epochs and about MAX_SEQUENCES pieces: bounded work."""
        epochs = self.tokens_per_batch / max(self.tokens_per_epoch(), 1)
        if epochs > MAX_EPOCHS_PER_BATCH:
            raise HydraulisError(
                f"a global batch of {self.tokens_per_batch:,} tokens would span {epochs:,.0f} epochs of a corpus "
                f"of {self.tokens_per_epoch():,} tokens (at most {MAX_EPOCHS_PER_BATCH}); lower the token budget"
            )
        check_batch_size(epochs * self.pieces_per_epoch(), "token-budget sampler")

    @property
    def state(self) -> SamplerState:
        return self._state

    @state.setter
    def state(self, state: SamplerState) -> None:
        if state.epoch < 0 or state.position < 0:
            raise HydraulisError(f"invalid sampler state {state}")
        pieces = len(self._epoch(state.epoch).lengths)
        if state.position > pieces:
            raise HydraulisError(
                f"sampler state position {state.position} is past the end of epoch {state.epoch} "
                f"({pieces} pieces): it was saved with other data or settings"
            )
        self._state = state

    def pieces_per_epoch(self) -> int:
        return len(self._epoch(0).lengths)

    def piece_lengths(self) -> np.ndarray:
        """Lengths of the pieces an epoch serves (after the over-long policy): the real length distribution."""
        return self._epoch(0).lengths.copy()

    def tokens_per_epoch(self) -> int:
        return int(self._epoch(0).cumsum[-1])

    def order(self, epoch: int) -> np.ndarray:
        """The document order of an epoch: a function of (seed, epoch) alone, the same on every rank."""
        docs = np.arange(len(self.lengths)) if self.documents is None else self.documents
        if self.mixture is not None:  # each piece's document (a split one several times), sources interleaved
            return self._epoch(epoch).docs.copy()
        if not self.shuffle:
            return docs
        return docs[np.random.default_rng([self.seed, epoch]).permutation(len(docs))]

    def _epoch(self, epoch: int) -> _Epoch:
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        if self.mixture is None:
            docs, starts, lens = self.pieces(self.order(epoch))
        else:
            drawable = np.arange(len(self.lengths)) if self.documents is None else self.documents
            docs, starts, lens = mixed_order(
                self.mixture, drawable, self.pieces, seed=self.seed, epoch=epoch, shuffle=self.shuffle
            )
        pieces = _Epoch(docs, starts, lens, _cumsum(lens))
        self._epoch_cache = (epoch, pieces)
        return pieces

    def pieces(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pieces these documents become under the over-long policy, in order: (docs, starts, lengths)."""
        docs = np.asarray(docs, dtype=np.int64)
        lens = self.lengths[docs]
        if self.max_len is None:
            return docs, np.zeros_like(lens), lens
        if self.policy == "drop":
            keep = lens <= self.max_len
            return docs[keep], np.zeros(int(keep.sum()), np.int64), lens[keep]
        if self.policy == "truncate":
            starts = np.zeros_like(lens)
            if self.first_targets is not None:  # SFT: the prompt goes first (module docstring)
                context = np.maximum(self.first_targets[docs] - 1, 0)
                starts = np.maximum(np.minimum(lens - self.max_len, context), 0)
            return docs, starts, np.minimum(lens, self.max_len)
        n_pieces, starts, piece_lens = split_pieces(lens, self.max_len)  # the last piece holds the rest
        return np.repeat(docs, n_pieces), starts, piece_lens

    def overlong(self, targets: Callable[[np.ndarray, np.ndarray, np.ndarray], int], total: int) -> Overlong | None:
        """What the policy does to the documents longer than max_len (None without max_len).

        `targets(docs, starts, lengths)` counts the target tokens of pieces (`IndexedCorpus.piece_targets`),
        `total` those of the whole documents.
        """
        if self.max_len is None:
            return None
        over = np.flatnonzero(self.lengths > self.max_len)
        if self.documents is not None:
            over = np.intersect1d(over, self.documents)
        docs, starts, lens = self.pieces(over)
        lost = targets(over, np.zeros_like(over), self.lengths[over]) - targets(docs, starts, lens)
        return Overlong(
            max_len=self.max_len, policy=self.policy, records=len(over), pieces=len(docs), targets_lost=int(lost),
            targets_kept=int(total - lost),
        )

    def next_batch(self) -> GlobalBatch:
        """The next global batch: pieces in order until the next one would exceed the budget."""
        start = self._state
        epoch, pos = start.epoch, start.position
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        room = self.tokens_per_batch
        while True:
            ep = self._epoch(epoch)
            n = len(ep.lengths)
            if pos >= n:
                epoch, pos = epoch + 1, 0
                if parts and not self.cross_epochs:
                    break
                continue
            # pieces pos..end-1 fit: their summed length stays within the room left
            end = int(np.searchsorted(ep.cumsum, ep.cumsum[pos] + room, side="right")) - 1
            end = min(end, n)
            if end > pos:
                parts.append((ep.docs[pos:end], ep.starts[pos:end], ep.lengths[pos:end]))
                room -= int(ep.cumsum[end] - ep.cumsum[pos])
                pos = end
            if pos < n:
                break  # the next piece does not fit: the batch is full
        if pos >= len(self._epoch(epoch).lengths):  # normalise an exhausted epoch to the next one's start
            epoch, pos = epoch + 1, 0
        self._state = SamplerState(epoch, pos)
        docs, starts, lens = (np.concatenate(x) for x in zip(*parts, strict=True))
        return GlobalBatch(docs, starts, lens, start, self._state)

    def batches(self, count: int) -> list[GlobalBatch]:
        if count < 0:
            raise HydraulisError(f"number of batches must be non-negative, got {count}")
        return [self.next_batch() for _ in range(count)]

    def __iter__(self) -> Iterator[GlobalBatch]:
        while True:
            yield self.next_batch()


@dataclass(frozen=True)
class Mixture:
    """Sources of one corpus: source i is documents [bounds[i], bounds[i + 1]), drawn at weights[i] (normalised)."""

    names: tuple[str, ...]
    bounds: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.names) + 1 or len(self.weights) != len(self.names) or not self.names:
            raise HydraulisError(f"a mixture needs one weight and one document range per source, got {self}")
        if any(not w > 0 or not np.isfinite(w) for w in self.weights):
            raise HydraulisError(f"mixture weights must be positive numbers, got {list(self.weights)}")
        total = sum(self.weights)
        object.__setattr__(self, "weights", tuple(w / total for w in self.weights))

    def source_of(self, docs: np.ndarray) -> np.ndarray:
        """The source of each document."""
        return np.searchsorted(np.asarray(self.bounds[1:]), np.asarray(docs, dtype=np.int64), side="right")


Pieces = tuple[np.ndarray, np.ndarray, np.ndarray]  # (docs, starts, lengths), as TokenBudgetSampler.pieces


def mixed_order(mixture: Mixture, docs: np.ndarray, pieces: Callable[[np.ndarray], Pieces], seed: int,
                epoch: int, shuffle: bool = True) -> Pieces:
    """A mixture's epoch: its pieces in order, a function of (seed, epoch) alone (module docstring).

    `docs`: the documents that may be drawn; `pieces(docs)`: what they serve under the over-long policy. The
    epoch serves T tokens, all that the drawable documents serve; source i gives the pieces starting in
    tokens [e w_i T, (e + 1) w_i T) of its stream, pass c of which is its documents shuffled by (seed, i, c)
    and cut into pieces, so no document repeats within a pass and no piece is skipped or served twice
    between epochs (a document may end in the next epoch). The pieces of all sources are merged by where
    each starts in its source's share: a long document's pieces are spread among the other sources'.
    """
    served = pieces(docs)
    tokens = np.bincount(served[0], weights=served[2], minlength=int(docs.max()) + 1 if len(docs) else 0)
    tokens = tokens.astype(np.int64)
    docs = docs[tokens[docs] > 0]
    source = mixture.source_of(docs)
    total = int(tokens[docs].sum())
    parts: list[Pieces] = []
    where, owner = [], []
    for i, weight in enumerate(mixture.weights):
        mine = docs[source == i]
        cycle = int(tokens[mine].sum())
        if cycle == 0:
            raise HydraulisError(f"mixture source {mixture.names[i]} has no document left to draw "
                                 "(every one held out or dropped by the over-long policy)")  # fmt: skip
        begin, end = int(epoch * weight * total), int((epoch + 1) * weight * total)
        for c in range(begin // cycle, (end - 1) // cycle + 1 if end > begin else begin // cycle):
            ids = mine[np.random.default_rng([seed, 0x4D4958, i, c]).permutation(len(mine))] if shuffle else mine
            d, s, n = pieces(ids)
            starts = c * cycle + _cumsum(n)[:-1]
            keep = (starts >= begin) & (starts < end)
            parts.append((d[keep], s[keep], n[keep]))
            where.append((starts[keep] - begin) / (end - begin))
            owner.append(np.full(int(keep.sum()), i))
    if not parts:
        return docs[:0], docs[:0], docs[:0]
    merged = np.lexsort((np.concatenate(owner), np.concatenate(where)))
    d, s, n = (np.concatenate(x)[merged] for x in zip(*parts, strict=True))
    return d, s, n


def held_out(documents: int, share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) document indices: each document held out with probability `share`, by the seed
    alone (the same split on every rank and every resume), at least one on each side."""
    if documents < 2:
        raise HydraulisError(f"holding out documents for evaluation needs at least 2, the corpus has {documents}")
    draw = np.random.default_rng([seed, 0x4556414C]).random(documents)  # its own stream: "EVAL"
    out = draw < share
    if not out.any():
        out[int(np.argmin(draw))] = True
    if out.all():
        out[int(np.argmax(draw))] = False
    return np.flatnonzero(~out), np.flatnonzero(out)


def _cumsum(values: np.ndarray) -> np.ndarray:
    out = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=out[1:])
    return out
