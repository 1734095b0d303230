"""Context parallelism: a CP group, and which of a micro-batch's tokens each of its ranks holds.

Attention over the group is runtime/modeling/context_attention.py.

`hydraulis.context.split_for_cp` decides which tokens each CP rank holds (long
documents in 2 cp zigzag chunks, short ones whole). Everything except
attention is per token, so each rank runs every layer on its own tokens only.
Attention of a split document needs keys and values of the whole document:

- forward: the K/V rows of this rank's split-document tokens are all-gathered
  over the CP group (padded to one size per rank, which gloo's tensor
  collectives need); a chunk at global positions [a, b) of its document
  attends to keys 0..b-1 as two blocks merged by log-sum-exp
  (runtime/modeling/blockwise_attention.py): its own keys causally and the gathered
  keys 0..a-1 with no mask, so no (chunk x prefix) mask or score matrix is
  built, and a rank's work is what the zigzag balances;
- backward: the gathered K/V's gradient is reduce-scattered back, so each
  rank receives the sum of every rank's dK/dV for the rows it owns.

Whole documents attend locally with no communication. Parameter gradients
of the CP ranks are partial (their tokens only): the optimizer's reduce sums
them as it sums replicas (CP ranks hold identical parameter shards).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from hydraulis.context import split_for_cp
from hydraulis.errors import HydraulisError


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its CP group; size 1 (group None) turns context parallelism off.

    `blocks[c]` is the group rank (torch numbers members in sorted global
    order) of CP rank c, so gathered blocks can be put into CP-rank order.
    """

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    blocks: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if self.size > 1 and self.group is None:
            raise HydraulisError(f"context parallel size {self.size} needs a process group")
        if not 0 <= self.rank < self.size:
            raise HydraulisError(f"context parallel rank {self.rank} is outside 0..{self.size - 1}")
        if sorted(self.blocks) != list(range(self.size)):
            raise HydraulisError(f"context parallel blocks {self.blocks} are not a permutation of 0..{self.size - 1}")


@dataclass(frozen=True)
class ContextShard:
    """What one CP rank needs to attend over its group, for one micro-batch.

    The rank's tokens are local segments in order: whole documents and chunks
    of split ones (and a padding segment under SP). Its split tokens
    (`gather_rows`, local rows) go to the K/V all-gather, `pad` rows per rank.
    A chunk at global positions [a, b) of its document attends to its own
    rows causally and to positions 0..a-1 in full: `keys` holds the rows of
    those prefix positions in the gathered K/V (CP-rank-major; empty for a
    document's first chunk), so each rank computes (b - a) * a + (b - a)^2 / 2
    scores per chunk, the causal share that the zigzag balances.
    """

    cp: int
    pad: int
    gather_rows: torch.Tensor  # (split tokens,) int64
    segments: tuple[tuple[int, int], ...]  # (start, end) local rows
    keys: tuple[torch.Tensor | None, ...]  # per segment: gathered rows of its prefix, None for a whole document

    @property
    def has_split(self) -> bool:
        return any(k is not None for k in self.keys)

    def to(self, device: torch.device | str) -> ContextShard:
        keys = tuple(None if k is None else k.to(device, non_blocking=True) for k in self.keys)
        return ContextShard(self.cp, self.pad, self.gather_rows.to(device, non_blocking=True), self.segments, keys)


def shard_layout(lengths: np.ndarray, cp: int, cp_rank: int) -> tuple[np.ndarray, np.ndarray, ContextShard]:
    """This rank's rows of the packed micro-batch, its segment lengths, and its attention plan."""
    split = split_for_cp(lengths, cp)
    doc, start, stop = split.segments(cp_rank)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    # micro-batch rows of each rank's split-document tokens, in that rank's local order
    split_rows = []
    for r in range(cp):
        d, a, b = split.segments(r)
        keep = split.split[d]
        split_rows.append(_ranges(offsets[d[keep]] + a[keep], offsets[d[keep]] + b[keep]))
    rows = _ranges(offsets[doc] + start, offsets[doc] + stop)
    lens = stop - start
    local_start = np.concatenate([[0], np.cumsum(lens)])[:-1]
    pad = max(len(r) for r in split_rows)
    # gathered position of every micro-batch row that takes part in the gather (CP-rank-major blocks of pad)
    where = np.full(int(offsets[-1]), -1, dtype=np.int64)
    for r, mine in enumerate(split_rows):
        where[mine] = r * pad + np.arange(len(mine))
    segments = tuple(zip(local_start.tolist(), (local_start + lens).tolist(), strict=True))
    keys = tuple(
        torch.from_numpy(where[offsets[d] : offsets[d] + a].copy()) if split.split[d] else None
        for d, a in zip(doc.tolist(), start.tolist(), strict=True)
    )
    gather_rows = np.flatnonzero(split.split[doc].repeat(lens))
    return rows, lens, ContextShard(cp, pad, torch.from_numpy(gather_rows), segments, keys)


def _ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """The concatenation of arange(a, b) for each (a, b), vectorised."""
    starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
    sizes = stops - starts
    if sizes.sum() == 0:
        return np.zeros(0, dtype=np.int64)
    first = np.repeat(starts - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
    return first + np.arange(int(sizes.sum()))
