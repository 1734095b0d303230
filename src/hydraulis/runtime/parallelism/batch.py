"""How a micro-batch of documents becomes model input.

A micro-batch is a few whole documents concatenated, without padding
between them (docs/design.md, section 6). For documents d_1..d_k of lengths s_1..s_k:

- `tokens` is their concatenation: T = s_1 + ... + s_k input tokens, exactly
  the tokens the planner counted against the replica's cap.
- `targets[t]` is the next token of the same document, and `IGNORE_INDEX` at
  the last token of every document: no target ever crosses a document
  boundary, so a document of s tokens has s - 1 real targets.
- `positions` restart at 0 at each document (RoPE sees each document as if
  it were alone).
- `cu_seqlens` holds the document boundaries [0, s_1, s_1 + s_2, ..., T];
  attention never crosses them.

SFT data adds a target mask per document (`masks`, data/sft.py): `mask[t]`
says whether token t is a target, so `targets[t]` is the next token only
where that token's mask is set; elsewhere (prompts, user turns) it is
`IGNORE_INDEX`. The mask rides with the tokens, so CP shards (sliced after
concatenation) and pipeline stages (the last one computes the loss) keep it.

With sequence parallelism the token count must divide by the TP degree;
`pad_to_multiple` then appends a padding "document" of token 0 with no
targets, which attends only to itself and so changes no real token's output,
loss or gradient.

The loss divides by the real targets of the WHOLE global batch
(`count_targets` over all its documents; with masks, the masked count), so any split into micro-batches and
replicas gives the gradient of one device.

With context parallelism (`concatenate_cp_shard`) a CP rank holds only its tokens of
the micro-batch (`hydraulis.context.split_for_cp`): targets and positions are
built on the whole micro-batch first and then sliced, so a chunk's last
token keeps the next chunk's first token as its target and RoPE sees global
positions. `context` then tells attention which rows to gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from hydraulis.data.manifest import CorpusManifest
from hydraulis.errors import HydraulisError
from hydraulis.runtime.parallelism.context_parallel import ContextShard, shard_layout

if TYPE_CHECKING:
    from hydraulis.cost.model import CostModel
    from hydraulis.data.sampler import GlobalBatch, TokenBudgetSampler
    from hydraulis.planner.plan import IterationPlan
    from hydraulis.runtime.parallelism.groups import ReplicaGroups

IGNORE_INDEX = -100


@dataclass(frozen=True)
class MicroBatchInput:
    """One micro-batch as the model takes it; every tensor is 1-D on CPU until `to`."""

    tokens: torch.Tensor  # (T,) int64
    targets: torch.Tensor  # (T,) int64, IGNORE_INDEX where there is none
    positions: torch.Tensor  # (T,) int64, restarting at each document
    cu_seqlens: torch.Tensor  # (num_segments + 1,) int32, padding segment included
    max_seqlen: int
    context: ContextShard | None = None  # this CP rank's attention plan; None without context parallelism
    policy: int = 0  # the micro-batch's memory policy (cost/policies.py's MemoryPolicy; 0: none)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())

    @property
    def seqlens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def to(self, device: torch.device | str) -> MicroBatchInput:
        return MicroBatchInput(
            tokens=self.tokens.to(device, non_blocking=True),
            targets=self.targets.to(device, non_blocking=True),
            positions=self.positions.to(device, non_blocking=True),
            cu_seqlens=self.cu_seqlens.to(device, non_blocking=True),
            max_seqlen=self.max_seqlen,
            context=None if self.context is None else self.context.to(device),
            policy=self.policy,
        )


def count_targets(lengths: Sequence[int]) -> int:
    """Real target tokens of documents with these lengths: s - 1 each."""
    return int(sum(max(int(s) - 1, 0) for s in lengths))


class Corpus(Protocol):
    """What the runtime reads of a corpus: documents' tokens, their target masks, the targets of pieces, and
    its manifest (what a checkpoint records of it; None for documents held in memory).

    data/indexed.py's IndexedCorpus and training/mixture.py's MixedCorpus are corpora; `TokenDocuments`
    holds documents in memory."""

    manifest: CorpusManifest | None

    def __getitem__(self, i: int) -> np.ndarray: ...

    def target_mask(self, i: int) -> np.ndarray | None:
        """Document i's target mask (1: a target), or None when every token after its first is one."""
        ...

    def piece_targets(self, docs: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> int:
        """Targets of document pieces (a piece's first token is none: nothing precedes it)."""
        ...


class TokenDocuments:
    """Documents' tokens held in memory (tests, benchmarks, `hydraulis check`): every token but a piece's first
    is a target."""

    manifest: CorpusManifest | None = None  # no built corpus: a checkpoint records none

    def __init__(self, documents: Sequence[np.ndarray]) -> None:
        self.documents = list(documents)

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.documents[i]

    def target_mask(self, i: int) -> np.ndarray | None:
        return None

    def piece_targets(self, docs: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> int:
        return count_targets(lengths)


class BatchSource:
    """The trainer's batches: the sampler draws them (the same on every rank), the corpus gives their tokens; a
    rank reads only its replica's documents."""

    def __init__(self, corpus: Corpus, sampler: TokenBudgetSampler) -> None:
        self.corpus = corpus
        self.sampler = sampler

    def micro_batches(
        self, batch: GlobalBatch, plan: IterationPlan, replica: int, groups: ReplicaGroups, cost: CostModel,
        corpus: Corpus | None = None,
    ) -> list[MicroBatchInput]:
        """Replica `replica`'s micro-batches of the plan, its CP rank's share of each, from the training corpus or
        `corpus` (evaluation's), each with the memory policy it runs (`cost.policy_run`, the plan's)."""
        pad = groups.config.tp if groups.tp.sequence_parallel else 1
        corpus = self.corpus if corpus is None else corpus
        out = []
        for k, mb in enumerate(plan.replicas[replica].micro_batches):
            docs, masks = [], []
            for i in mb:
                start, end = int(batch.starts[i]), int(batch.starts[i]) + int(batch.lengths[i])
                docs.append(torch.from_numpy(np.asarray(corpus[int(batch.docs[i])][start:end], dtype=np.int64)))
                mask = corpus.target_mask(int(batch.docs[i]))  # SFT corpora: which tokens are targets
                masks.append(None if mask is None else torch.from_numpy(np.array(mask[start:end], dtype=np.uint8)))
            joined = concatenate_cp_shard(docs, groups.cp.size, groups.cp.rank, pad_to_multiple=pad, masks=masks)
            out.append(replace(joined, policy=int(cost.policy_run(groups.config, plan.policy(replica, k)))))
        return out

    def targets(self, batch: GlobalBatch, corpus: Corpus | None = None) -> int:
        """The loss's denominator: targets of the whole global batch (SFT: the masked ones), at least 1."""
        n = (self.corpus if corpus is None else corpus).piece_targets(batch.docs, batch.starts, batch.lengths)
        return max(int(n), 1)


Masks = Sequence[Sequence[int] | torch.Tensor | None] | None


def concatenate_documents(
    documents: Sequence[Sequence[int] | torch.Tensor], pad_to_multiple: int = 1, masks: Masks = None
) -> MicroBatchInput:
    """Concatenate whole documents into one micro-batch (see the module docstring).

    `masks`, one per document (None: every token a target), keep targets only where the next token's is set.
    """
    if not documents:
        raise HydraulisError("a micro-batch needs at least one document")
    if pad_to_multiple < 1:
        raise HydraulisError(f"pad_to_multiple must be positive, got {pad_to_multiple}")
    docs = [torch.as_tensor(d, dtype=torch.int64).reshape(-1) for d in documents]
    for i, d in enumerate(docs):
        if d.numel() == 0:
            raise HydraulisError(f"micro-batch document {i} is empty")
    lengths = [int(d.numel()) for d in docs]
    if masks is not None and len(masks) != len(docs):
        raise HydraulisError(f"{len(masks)} target masks for {len(docs)} documents")
    keep = [None if m is None else torch.as_tensor(m).reshape(-1).to(torch.bool) for m in (masks or [None] * len(docs))]
    for i, (m, n) in enumerate(zip(keep, lengths, strict=True)):
        if m is not None and m.numel() != n:
            raise HydraulisError(f"micro-batch document {i}: a target mask of {m.numel()} for {n} tokens")
    pad = -sum(lengths) % pad_to_multiple
    if pad:
        docs.append(torch.zeros(pad, dtype=torch.int64))
        lengths.append(pad)
    targets = []
    for i, d in enumerate(docs):
        t = torch.full_like(d, IGNORE_INDEX)
        if not (pad and i == len(docs) - 1):
            t[:-1] = d[1:]
            if i < len(keep) and keep[i] is not None:
                t[:-1][~keep[i][1:]] = IGNORE_INDEX
        targets.append(t)
    return MicroBatchInput(
        tokens=torch.cat(docs),
        targets=torch.cat(targets),
        positions=torch.cat([torch.arange(s, dtype=torch.int64) for s in lengths]),
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        max_seqlen=max(lengths),
    )


def concatenate_cp_shard(
    documents: Sequence[Sequence[int] | torch.Tensor],
    cp: int,
    cp_rank: int,
    pad_to_multiple: int = 1,
    masks: Masks = None,
) -> MicroBatchInput:
    """CP rank `cp_rank`'s share of one micro-batch (see the module docstring); cp = 1 is `concatenate_documents`."""
    if cp == 1:
        return concatenate_documents(documents, pad_to_multiple, masks)
    if pad_to_multiple < 1:
        raise HydraulisError(f"pad_to_multiple must be positive, got {pad_to_multiple}")
    full = concatenate_documents(documents, masks=masks)
    rows, lens, shard = shard_layout(np.asarray(full.seqlens, dtype=np.int64), cp, cp_rank)
    index = torch.from_numpy(rows)
    tokens, targets, positions = full.tokens[index], full.targets[index], full.positions[index]
    pad = -len(rows) % pad_to_multiple
    if pad:  # a padding segment, whole on this rank: it attends only to itself and has no targets
        tokens = torch.cat([tokens, torch.zeros(pad, dtype=torch.int64)])
        targets = torch.cat([targets, torch.full((pad,), IGNORE_INDEX, dtype=torch.int64)])
        positions = torch.cat([positions, torch.arange(pad, dtype=torch.int64)])
        lens = np.append(lens, pad)
        shard = replace(shard, segments=(*shard.segments, (len(rows), len(rows) + pad)), keys=(*shard.keys, None))
    return MicroBatchInput(
        tokens=tokens,
        targets=targets,
        positions=positions,
        cu_seqlens=torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32),
        max_seqlen=int(lens.max()) if len(lens) else 0,
        context=shard,
    )
