"""How one micro-batch is spread over the ranks of a context-parallel (CP) group (numpy only).

Every CP rank of a pipeline stage computes the same layers on its share of
the micro-batch's tokens; attention is exact because K/V of split documents
are gathered over the group (runtime/parallelism/context_parallel.py). The planner and
the runtime both use `split_for_cp`, so it imports no torch.

- A long document is cut into 2 * cp chunks of (almost) equal length, and CP
  rank k takes chunks k and 2cp - 1 - k (the zigzag of ring attention): under
  a causal mask early chunks are cheap and late ones expensive, so every rank
  gets the same attention work.
- A short document stays whole on one rank (it needs no communication); the
  whole documents are placed longest first on the least-loaded rank.
- Documents are split longest first until every rank holds at most
  `max_rank_tokens(T, cp)` = ceil(T / cp) + 2 cp of the micro-batch's T
  tokens: the memory the cost model gives a CP rank (activations / cp) plus
  the rounding of the chunks. A document shorter than 2 cp is never split,
  and never has to be: whole, it adds less than 2 cp to the balanced load.
- Every rank gets tokens, except in a micro-batch of fewer than cp
  documents all shorter than 2 cp (a few tokens in all): there some ranks
  hold none, and the runtime runs them on zero tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.errors import HydraulisError


def max_rank_tokens(total_tokens: int, cp: int) -> int:
    """The most tokens `split_for_cp` leaves on one CP rank of a micro-batch of `total_tokens`."""
    if cp < 1:
        raise HydraulisError(f"context parallel degree must be positive, got cp={cp}")
    if cp == 1:
        return int(total_tokens)
    return -(-int(total_tokens) // cp) + 2 * cp


@dataclass(frozen=True)
class ContextSplit:
    """Which token ranges of which documents each CP rank holds.

    Segments are rows of (rank, doc, start, stop): tokens [start, stop) of
    document `doc` (its index in the micro-batch) live on CP rank `rank`.
    Every token of every document is in exactly one segment.
    """

    cp: int
    lengths: np.ndarray  # (n,) int64, the micro-batch's documents
    split: np.ndarray  # (n,) bool: the document is cut into 2 cp zigzag chunks
    rank: np.ndarray  # (m,) int64
    doc: np.ndarray  # (m,) int64
    start: np.ndarray  # (m,) int64
    stop: np.ndarray  # (m,) int64

    def segments(self, cp_rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(doc, start, stop) of one rank's segments, in its token order: by document, then by position."""
        if not 0 <= cp_rank < self.cp:
            raise HydraulisError(f"CP rank {cp_rank} is outside 0..{self.cp - 1}")
        mine = np.flatnonzero(self.rank == cp_rank)
        mine = mine[np.lexsort((self.start[mine], self.doc[mine]))]
        return self.doc[mine], self.start[mine], self.stop[mine]

    def rank_tokens(self) -> np.ndarray:
        """(cp,) tokens each CP rank holds."""
        return np.bincount(self.rank, weights=self.stop - self.start, minlength=self.cp).astype(np.int64)


def zigzag_chunks(length: int, cp: int, extra_order: np.ndarray) -> np.ndarray:
    """(2 cp + 1,) chunk boundaries of one document; the length % 2cp extra tokens go to ranks in `extra_order`.

    Rank k owns chunks k and 2cp - 1 - k; a rank early in `extra_order` gets
    one extra token in its first chunk, and (when more than cp are left over)
    one in its second.
    """
    base, extra = divmod(int(length), 2 * cp)
    sizes = np.full(2 * cp, base, dtype=np.int64)
    first = np.asarray(extra_order[: min(extra, cp)], dtype=np.int64)
    second = np.asarray(extra_order[: max(extra - cp, 0)], dtype=np.int64)
    sizes[first] += 1
    sizes[2 * cp - 1 - second] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


def _place(lengths: np.ndarray, order: np.ndarray, split: np.ndarray, cp: int) -> tuple[np.ndarray, ...]:
    """Segments (rank, doc, start, stop) and per-rank loads: split documents first, then whole ones (LPT)."""
    loads = np.zeros(cp, dtype=np.int64)
    rows: list[tuple[int, int, int, int]] = []
    ranks = np.arange(cp)
    for d in order[split[order]]:
        bounds = zigzag_chunks(int(lengths[d]), cp, np.argsort(loads, kind="stable"))
        for chunks in (ranks, 2 * cp - 1 - ranks):
            rows.extend(zip(ranks.tolist(), [int(d)] * cp, bounds[chunks].tolist(), bounds[chunks + 1].tolist(),
                            strict=True))
        loads += bounds[ranks + 1] - bounds[ranks] + bounds[2 * cp - ranks] - bounds[2 * cp - 1 - ranks]
    for d in order[~split[order]]:
        r = int(np.argmin(loads))
        rows.append((r, int(d), 0, int(lengths[d])))
        loads[r] += lengths[d]
    table = np.array(rows, dtype=np.int64).reshape(-1, 4)
    return table[:, 0], table[:, 1], table[:, 2], table[:, 3], loads


def split_for_cp(lengths: Sequence[int] | np.ndarray, cp: int) -> ContextSplit:
    """Spread one micro-batch's documents over cp ranks (see the module docstring).

    Splits the fewest documents, longest first, such that every rank holds at
    most `max_rank_tokens` tokens and, where the micro-batch allows, none is empty.
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if not isinstance(cp, int | np.integer) or cp < 1:
        raise HydraulisError(f"context parallel degree must be a positive integer, got cp={cp!r}")
    if len(lengths) == 0:
        raise HydraulisError("a micro-batch needs at least one document to split over CP ranks")
    if (lengths < 1).any():
        raise HydraulisError(f"micro-batch document {int(np.argmin(lengths))} is empty")
    bound = max_rank_tokens(int(lengths.sum()), cp)
    order = np.argsort(-lengths, kind="stable")
    split = np.zeros(len(lengths), dtype=bool)
    splittable = int((lengths >= 2 * cp).sum()) if cp > 1 else 0
    for k in range(splittable + 1):
        split[order[:k]] = True
        rank, doc, start, stop, loads = _place(lengths, order, split, cp)
        if loads.max() <= bound and loads.min() > 0:
            break
    return ContextSplit(cp=cp, lengths=lengths, split=split.copy(), rank=rank, doc=doc, start=start, stop=stop)
