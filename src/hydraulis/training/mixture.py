"""`[data]` mixtures: several corpora, with weights, seen by the run as one corpus.

`MixedCorpus` puts its sources' documents one after another: document
`bounds[i] + k` is document k of source i. It answers what the runtime and
the job read of a corpus (`corpus[d]`, `lengths`, `target_mask`,
`piece_targets`, `first_targets`, `manifest`), so the trainer, evaluation,
checkpoints and the over-long policy need nothing new. Its `mixture` is what
the sampler draws by (data/sampler.py `mixed_order`): each source's share of
the tokens follows its weight, deterministically from the seed. Every step,
`source_counts` says how many tokens and targets each source gave the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hydraulis.data.indexed import IndexedCorpus, open_corpus
from hydraulis.data.readers import ReadReport
from hydraulis.data.sampler import GlobalBatch, Mixture
from hydraulis.errors import HydraulisError
from hydraulis.training.job_config import DataChoice


@dataclass(frozen=True)
class MixtureSpec:
    """A mixture as a job carries it to its ranks: each source's name, built corpus directory and weight."""

    names: tuple[str, ...]
    paths: tuple[str, ...]
    weights: tuple[float, ...]

    def shares(self) -> dict[str, float]:
        """Each source's weight, normalised."""
        return {n: w / sum(self.weights) for n, w in zip(self.names, self.weights, strict=True)}

    def open(self) -> MixedCorpus:
        return MixedCorpus(tuple(open_corpus(p) for p in self.paths), self.names, self.weights)


def training_corpus(
    data: DataChoice, open_one: Callable[[str, str], IndexedCorpus]
) -> tuple[IndexedCorpus | MixedCorpus, MixtureSpec | None]:
    """The run's corpus: `[data] corpus` opened by `open_one(name, key)` (which checks its tokenizer), or the
    mixture of its corpora and the spec the ranks open it by."""
    if isinstance(data.corpus, str):
        return open_one(data.corpus, "data.corpus"), None
    corpora = tuple(open_one(c, f"data.corpus[{i}]") for i, c in enumerate(data.corpus))
    spec = MixtureSpec(source_names(corpora), tuple(str(c.path) for c in corpora), tuple(data.weights or ()))
    return MixedCorpus(corpora, spec.names, spec.weights), spec


def source_names(corpora: Sequence[IndexedCorpus]) -> tuple[str, ...]:
    """Each source's name in metrics: its corpus's name, numbered when two share one."""
    names = [c.name for c in corpora]
    return tuple(n if names.count(n) == 1 else f"{n}#{i + 1}" for i, n in enumerate(names))


class MixedCorpus:
    """Several built corpora as one (module docstring); the same tokenizer is checked by the job."""

    def __init__(self, sources: tuple[IndexedCorpus, ...], names: tuple[str, ...], weights: tuple[float, ...]):
        pairs = list(zip(names, sources, strict=True))
        if len({c.manifest.tokenizer for c in sources}) > 1:
            made = ", ".join(f"{n}: {c.manifest.tokenizer}" for n, c in pairs)
            raise HydraulisError(f"the mixture's corpora are tokenized differently ({made}); rebuild them alike")
        self.sources = sources
        self.bounds = np.concatenate([[0], np.cumsum([len(c) for c in sources])]).astype(np.int64)
        self.mixture = Mixture(names, tuple(int(b) for b in self.bounds), weights)
        self.lengths = np.concatenate([c.lengths for c in sources])
        self.path = "mixture:" + "+".join(str(c.path) for c in sources)  # what DataSettings and EvalSet name
        first, shares = sources[0].manifest, zip(names, self.mixture.weights, strict=True)
        self.manifest = replace(
            first,
            name="+".join(names),
            source="mixture of " + ", ".join(f"{n} ({w:.3g})" for n, w in shares),
            documents=len(self.lengths),
            tokens=sum(c.manifest.tokens for c in sources),
            max_length=max(c.manifest.max_length for c in sources),
            report=ReadReport(),
            checksums={f"{n}/{k}": v for n, c in pairs for k, v in c.manifest.checksums.items()},
            targets=sum(c.manifest.target_tokens for c in sources),
            masked=any(c.manifest.masked for c in sources),
            overlong=None,
        )

    @property
    def names(self) -> tuple[str, ...]:
        return self.mixture.names

    @property
    def name(self) -> str:
        return self.manifest.name

    def __len__(self) -> int:
        return len(self.lengths)

    def _locate(self, i: int) -> tuple[IndexedCorpus, int]:
        n = len(self.lengths)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for {n} documents")
        i %= n
        s = int(self.mixture.source_of(np.array([i]))[0])
        return self.sources[s], i - int(self.bounds[s])

    def __getitem__(self, i: int) -> np.ndarray:
        corpus, k = self._locate(i)
        return corpus[k]

    def target_mask(self, i: int) -> np.ndarray | None:
        corpus, k = self._locate(i)
        return corpus.target_mask(k)

    def _split(self, docs: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Per source, the positions in `docs` of its documents."""
        owner = self.mixture.source_of(docs)
        return [(s, np.flatnonzero(owner == s)) for s in range(len(self.sources))]

    def piece_targets(self, docs: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> int:
        docs, starts, lengths = (np.asarray(x, dtype=np.int64) for x in (docs, starts, lengths))
        return sum(self.sources[s].piece_targets(docs[at] - self.bounds[s], starts[at], lengths[at])
                   for s, at in self._split(docs))  # fmt: skip

    def first_targets(self, docs: np.ndarray) -> np.ndarray:
        docs = np.asarray(docs, dtype=np.int64)
        out = np.empty(len(docs), dtype=np.int64)
        for s, at in self._split(docs):
            out[at] = self.sources[s].first_targets(docs[at] - self.bounds[s])
        return out

    def source_counts(self, batch: GlobalBatch) -> dict[str, Any]:
        """Each source's tokens and targets in a batch: a metrics row's `source_tokens` and `source_targets`."""
        tokens, targets = {}, {}
        for s, at in self._split(batch.docs):
            tokens[self.names[s]] = int(batch.lengths[at].sum())
            targets[self.names[s]] = self.sources[s].piece_targets(
                batch.docs[at] - self.bounds[s], batch.starts[at], batch.lengths[at]
            )
        return {"source_tokens": tokens, "source_targets": targets}


def source_shares(rows: Sequence[dict[str, Any]], weights: dict[str, float]) -> dict[str, dict[str, Any]] | None:
    """The summary's `sources`: per source, its tokens and targets over the steps, their shares, its weight."""
    if not rows or "source_tokens" not in rows[0]:
        return None
    out = {}
    totals = {key: sum(sum(r[key].values()) for r in rows) for key in ("source_tokens", "source_targets")}
    for name, weight in weights.items():
        tokens = sum(r["source_tokens"].get(name, 0) for r in rows)
        targets = sum(r["source_targets"].get(name, 0) for r in rows)
        out[name] = {"weight": weight, "tokens": tokens, "targets": targets,
                     "token_share": tokens / max(totals["source_tokens"], 1),
                     "target_share": targets / max(totals["source_targets"], 1)}  # fmt: skip
    return out
