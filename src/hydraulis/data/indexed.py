"""Indexed corpora: tokens in one memory-mapped file, plus an index of document offsets and lengths.

A corpus is a directory:

    tokens.bin     every document's tokens (a text and a prompt/completion end with the
                   end-of-document token, a chat as its template ends it), back to back,
                   little-endian uint16 (vocabulary <= 65536) or uint32
    index.idx      32-byte header (magic, version, token size, documents, tokens),
                   then int64 offsets[documents], then int64 lengths[documents]
    mask.bin       SFT corpora only: one byte per token, 1 where the token is a target
                   (the loss counts predicting it), 0 in prompts and non-assistant turns
    manifest.json  `hydraulis.corpus/1` (manifest.py): source, tokenizer identity, counts,
                   target tokens, what the readers skipped or repaired, sha256 of every file

Reading a document is O(1): a slice of the memory map at its offset. Lengths
(what the planner needs) come from the index without touching the tokens.

A corpus is built by `data/build/` (corpus.py): on every core, atomically, resumable.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from hydraulis.data.manifest import INDEX_FILE, MANIFEST_FILE, MASK_FILE, TOKENS_FILE, CorpusManifest
from hydraulis.data.sampler import Mixture, Overlong, Policy, TokenBudgetSampler
from hydraulis.data.tokenizer import get_tokenizer, token_dtype
from hydraulis.errors import HydraulisError
from hydraulis.files import not_found, sha256_file

__all__ = ["INDEX_FILE", "MANIFEST_FILE", "MASK_FILE", "TOKENS_FILE", "CorpusManifest", "IndexedCorpus"]

INDEX_MAGIC = b"HYDIDX\x00\x01"
INDEX_VERSION = 1
INDEX_HEADER = struct.Struct("<8sIIQQ")  # magic, version, token itemsize, documents, tokens


class IndexedCorpus:
    """A built corpus, opened read-only. `corpus[i]` is document i's tokens (a memory-map view, no copy)."""

    mixture: Mixture | None = None  # one source (training/mixture.py's MixedCorpus: its sources and weights)

    def __init__(
        self,
        path: Path,
        manifest: CorpusManifest,
        tokens: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        mask: np.ndarray | None = None,
    ):
        self.path = path
        self.manifest = manifest
        self.tokens = tokens
        self.offsets = offsets
        self.lengths = lengths  # int64, one per document, end-of-document token included
        self.mask = mask  # uint8 per token (1: a target), or None: every token is one
        self._targets: np.ndarray | None = None  # each document's targets, counted when first needed

    def target_mask(self, i: int) -> np.ndarray | None:
        """Document i's target mask (a memory-map view), or None when every token is a target."""
        if self.mask is None:
            return None
        start = int(self.offsets[i])
        return self.mask[start : start + int(self.lengths[i])]

    def piece_targets(self, docs: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> int:
        """Targets of document pieces: the tokens after each piece's first whose mask is set."""
        docs, starts, lengths = (np.asarray(x, dtype=np.int64) for x in (docs, starts, lengths))
        if self.mask is None:
            return int(np.maximum(lengths - 1, 0).sum())
        whole = (starts == 0) & (lengths == self.lengths[docs])
        total = int(self._doc_targets()[docs[whole]].sum())
        for d, s, n in zip(docs[~whole], starts[~whole], lengths[~whole], strict=True):
            begin = int(self.offsets[int(d)]) + int(s)
            total += int(np.count_nonzero(self.mask[begin + 1 : begin + int(n)]))
        return total

    def _doc_targets(self) -> np.ndarray:
        """Each whole document's targets (masked corpora): one pass over mask.bin, the first time."""
        if self._targets is None:
            assert self.mask is not None
            self._targets = np.add.reduceat(self.mask, self.offsets, dtype=np.int64) - self.mask[self.offsets]
        return self._targets

    def first_targets(self, docs: np.ndarray) -> np.ndarray:
        """Where each document's first target token is: 1 without a mask, a document's length if it has none."""
        docs = np.asarray(docs, dtype=np.int64)
        if self.mask is None:
            return np.ones(len(docs), dtype=np.int64)
        out = np.empty(len(docs), dtype=np.int64)
        for k, d in enumerate(docs):
            rest = self.target_mask(int(d))[1:]
            at = int(np.argmax(rest)) if len(rest) else 0
            out[k] = at + 1 if len(rest) and rest[at] else len(rest) + 1
        return out

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def num_tokens(self) -> int:
        return self.manifest.tokens

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self.lengths)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for {n} documents")
        start = int(self.offsets[i])
        return self.tokens[start : start + int(self.lengths[i])]

    def text(self, i: int) -> str:
        """Document i decoded back to text (without its end-of-document token)."""
        tokens = self[i]
        if self.manifest.eod_appended and len(tokens) and tokens[-1] == self.manifest.eod_id:
            tokens = tokens[:-1]  # a chat ends as its template ends it
        return get_tokenizer(self.manifest.tokenizer_source or self.manifest.tokenizer).decode(tokens)

    def verify(self) -> None:
        """Recompute both checksums (reads every byte); raise if the files changed since the build."""
        for name, expected in self.manifest.checksums.items():
            if _sha256_file(self.path / name) != expected:
                raise HydraulisError(f"{self.path / name}: checksum differs from {self.path / MANIFEST_FILE}")


def corpus_sampler(
    corpus: IndexedCorpus, tokens_per_batch: int, max_len: int | None, seed: int = 0, policy: Policy = "split",
    documents: np.ndarray | None = None, mixture: Mixture | None = None, **order: bool,
) -> TokenBudgetSampler:
    """The token-budget sampler of a corpus (or of these `documents` of it; a mixture's sources drawn by their
    weights); with `truncate` an SFT record keeps its targets (sampler.py). `order`: its shuffle and cross_epochs."""
    first = None
    if corpus.manifest.masked and policy == "truncate" and max_len is not None:
        over = np.flatnonzero(corpus.lengths > max_len)
        first = np.ones(len(corpus), dtype=np.int64)
        first[over] = corpus.first_targets(over)
    return TokenBudgetSampler(
        corpus.lengths, tokens_per_batch, max_len, seed, policy, first_targets=first, documents=documents,
        mixture=mixture, **order,
    )


def overlong(corpus: IndexedCorpus, sampler: TokenBudgetSampler) -> Overlong | None:
    """What the sampler's over-long policy does to the corpus (records cut, target tokens lost)."""
    return sampler.overlong(corpus.piece_targets, corpus.manifest.target_tokens)


def open_corpus(path: str | Path, verify: bool = False) -> IndexedCorpus:
    """Open a built corpus; a missing, truncated or inconsistent file is an error that names it."""
    path = Path(path)
    if not path.is_dir():
        raise HydraulisError(not_found(path, "no such corpus directory"))
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise HydraulisError(f"{path}: not a built corpus (no {MANIFEST_FILE}; build it with `hydraulis data build`)")
    manifest = CorpusManifest.load(manifest_path)
    offsets, lengths, itemsize, total = _read_index(path / INDEX_FILE)
    where = f"{manifest_path} disagrees with {path / INDEX_FILE}"
    if (len(lengths), total) != (manifest.documents, manifest.tokens):
        raise HydraulisError(
            f"{where}: {manifest.documents} documents / {manifest.tokens} tokens "
            f"vs {len(lengths)} / {total} (rebuild the corpus)"
        )
    dtype = token_dtype(manifest.vocab_size)
    if dtype.itemsize != itemsize or dtype.name != manifest.dtype:
        raise HydraulisError(f"{where}: token size {itemsize} bytes vs dtype {manifest.dtype}")
    tokens_path = path / TOKENS_FILE
    try:
        size = tokens_path.stat().st_size
    except FileNotFoundError:
        raise HydraulisError(f"{tokens_path}: missing (rebuild the corpus)") from None
    if size != total * itemsize:
        state = "truncated" if size < total * itemsize else "too long"
        raise HydraulisError(
            f"{tokens_path}: {state}: {size} bytes, the index needs {total * itemsize} (rebuild the corpus)"
        )
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(total,))
    mask = None
    if manifest.masked:
        mask_path = path / MASK_FILE
        if not mask_path.is_file() or mask_path.stat().st_size != total:
            raise HydraulisError(f"{mask_path}: missing or not one byte per token (rebuild the corpus)")
        mask = np.memmap(mask_path, dtype=np.uint8, mode="r", shape=(total,))
    corpus = IndexedCorpus(path, manifest, tokens=tokens, offsets=offsets, lengths=lengths, mask=mask)
    if verify:
        corpus.verify()
    return corpus


def _read_index(path: Path) -> tuple[np.ndarray, np.ndarray, int, int]:
    try:
        with path.open("rb") as fh:
            head = fh.read(INDEX_HEADER.size)
            size = os.fstat(fh.fileno()).st_size
    except FileNotFoundError:
        raise HydraulisError(f"{path}: missing (rebuild the corpus)") from None
    except OSError as exc:
        raise HydraulisError(f"{path}: cannot read: {exc}") from None
    if len(head) < INDEX_HEADER.size:
        raise HydraulisError(f"{path}: truncated: {size} bytes, shorter than the {INDEX_HEADER.size}-byte header")
    magic, version, itemsize, count, total = INDEX_HEADER.unpack(head)
    if magic != INDEX_MAGIC:
        raise HydraulisError(f"{path}: not a hydraulis index (bad magic bytes)")
    if version != INDEX_VERSION:
        raise HydraulisError(f"{path}: index version {version}, this hydraulis reads version {INDEX_VERSION}")
    if itemsize not in (2, 4):
        raise HydraulisError(f"{path}: corrupt header: token size {itemsize} bytes")
    expected = INDEX_HEADER.size + 16 * count
    if size != expected:
        state = "truncated" if size < expected else "corrupt (trailing bytes)"
        raise HydraulisError(f"{path}: {state}: {size} bytes, {count} documents need {expected} (rebuild the corpus)")
    if count == 0:
        raise HydraulisError(f"{path}: corrupt: no documents")
    table = np.fromfile(path, dtype="<i8", offset=INDEX_HEADER.size).reshape(2, count)
    offsets, lengths = table[0], table[1]
    ok = (
        offsets[0] == 0
        and bool(np.all(lengths >= 1))
        and bool(np.all(offsets[1:] == offsets[:-1] + lengths[:-1]))
        and int(offsets[-1] + lengths[-1]) == total
    )
    if not ok:
        raise HydraulisError(f"{path}: corrupt: document offsets and lengths are inconsistent (rebuild the corpus)")
    offsets.flags.writeable = False
    lengths.flags.writeable = False
    return offsets, lengths, itemsize, total


def check_targets_left(cut: Overlong, setting: str) -> None:
    """Refuse a corpus that would train on nothing: every target token cut away by the over-long policy."""
    if cut.targets_kept == 0:
        raise HydraulisError(
            f"{setting}: no target token is left ({cut.describe()}): nothing to train on; "
            "raise max_len or choose another over-long policy"
        )


def _sha256_file(path: Path) -> str:
    try:
        return sha256_file(path)
    except FileNotFoundError:
        raise HydraulisError(f"{path}: missing (rebuild the corpus)") from None
