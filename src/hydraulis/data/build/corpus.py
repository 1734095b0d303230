"""Building a corpus: samples in, a corpus directory (indexed.py's format) out, on every core, atomically.

The samples are read in this process (reading and parsing cost a few percent of tokenizing) and cut into
chunks of about CHUNK_CHARS characters or CHUNK_DOCS documents; forked workers (processes/stream_map.py)
tokenize the chunks, each into a part of its own (parts.py), and this process appends the finished parts,
in the input's order, to the corpus it assembles in a hidden temporary directory (staging.py): tokens.bin,
mask.bin from the first SFT record on (the documents before it get ones), index.idx, and manifest.json
last. The chunks do not depend on the number of workers, so the corpus does not either, to the byte.
Memory is bounded by the chunks in flight (two per worker), not the corpus.

The directory is renamed into place when complete, and the parts removed after it: a build killed at any
point leaves nothing `open_corpus` accepts, and the next build of the same corpus (the same `resume` key)
reuses the finished parts: it reads the input again but tokenizes only what is missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

from hydraulis.data.build.parts import Part, PartsDir, held_parts
from hydraulis.data.build.staging import OWNER_FILE, default_permissions, occupied, sweep_temporaries, temp_dir
from hydraulis.data.indexed import (
    INDEX_HEADER,
    INDEX_MAGIC,
    INDEX_VERSION,
    IndexedCorpus,
    check_targets_left,
    corpus_sampler,
    open_corpus,
    overlong,
)
from hydraulis.data.manifest import INDEX_FILE, MANIFEST_FILE, MASK_FILE, TOKENS_FILE, CorpusManifest
from hydraulis.data.readers import ReadCounts, ReadReport
from hydraulis.data.records import Chat, PromptCompletion, Sample
from hydraulis.data.sampler import Policy
from hydraulis.data.sft import encode_samples
from hydraulis.data.tokenizer import Tokenizer, get_tokenizer, token_dtype
from hydraulis.errors import HydraulisError
from hydraulis.files import replace_directory, write_json_atomic
from hydraulis.processes import interrupt
from hydraulis.processes.fan_out import usable_workers
from hydraulis.processes.stream_map import WorkerLost, stream_map

CHUNK_CHARS = 4_000_000  # characters a worker tokenizes at once: bounds memory, amortizes the hand-over
CHUNK_DOCS = 1024
COPY_BYTES = 1 << 22

IfExists = Literal["error", "replace", "keep"]


def build_corpus(
    documents: Iterable[Sample],
    out: str | Path,
    tokenizer: Tokenizer | str,
    source: str,
    counts: ReadCounts | None = None,
    name: str | None = None,
    if_exists: IfExists = "error",
    skip_bad: bool = False,
    overlong: tuple[int, Policy] | None = None,
    workers: int | None = None,
    resume: str | None = None,
) -> IndexedCorpus:
    """Tokenize documents into a corpus directory at `out`, atomically (module docstring).

    `counts` is the readers' counter object (filled while `documents` is consumed); its final state goes
    into the manifest. `if_exists` says what to do when `out` already exists: fail, replace it, or keep it
    (the cache, when two processes build the same corpus at once). `skip_bad` skips SFT records with no
    target token instead of refusing them. `overlong` (max_len, policy): the manifest says what training
    with them cuts; a corpus left without target tokens by them is refused. `workers`: processes that
    tokenize (default: the cores this process may use). `resume`: what identifies the input (its files'
    sizes and times, the read options); the finished parts of a killed build with the same are reused.
    """
    out = Path(out)
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    counts = counts if counts is not None else ReadCounts()
    if out.exists() and not out.is_dir():
        raise HydraulisError(f"{out}: exists and is not a directory")
    if occupied(out) and if_exists == "error":
        raise HydraulisError(f"{out}: already exists (pass --force to replace it)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        swept = sweep_temporaries(out)
    except OSError as exc:
        raise HydraulisError(f"{out}: cannot create the corpus directory: {exc.strerror or exc}") from None
    if swept:
        print(
            f"removed {swept} temporary director{'y' if swept == 1 else 'ies'} left by an interrupted build "
            f"in {out.parent.absolute()}",
            file=sys.stderr,
        )
    dtype = token_dtype(tok.vocab_size)
    with held_parts(out, dtype.itemsize) as parts:
        if occupied(out) and if_exists == "keep":  # another process built it while this one waited
            if not parts.any_finished():
                parts.remove()
            return open_corpus(out)
        if if_exists == "replace" and resume == source and (fresh := _built_from(out, source)) is not None:
            return fresh  # a cache's stale corpus that another process (a torchrun rank) rebuilt while this one waited
        key = None if resume is None else "\n".join([resume, source, tok.name, f"skip_bad={skip_bad}",
                                                     f"chunks={CHUNK_CHARS},{CHUNK_DOCS}", dtype.name])  # fmt: skip
        parts.start(key)
        build = _Build(parts, tok, dtype, skip_bad, resumable=key is not None)
        workers = usable_workers(per_rank=False) if workers is None else workers
        return _build(
            build, documents, out=out, source=source, counts=counts, name=name or out.name, if_exists=if_exists,
            cut=overlong, workers=workers,
        )


def _built_from(out: Path, source: str) -> IndexedCorpus | None:
    """The corpus at `out` when it is whole and was built from `source`."""
    try:
        corpus = open_corpus(out)
    except HydraulisError:
        return None
    return corpus if corpus.manifest.source == source else None


def _build(
    build: _Build, documents: Iterable[Sample], out: Path, source: str, counts: ReadCounts, name: str,
    if_exists: IfExists, cut: tuple[int, Policy] | None, workers: int,
) -> IndexedCorpus:  # fmt: skip
    """Assemble in a temporary directory, publish, then drop the parts; an input error drops them too, an
    interruption keeps them for the next build."""
    tmp: Path | None = None
    try:
        try:
            tmp = temp_dir(out, ".tmp")
        except OSError as exc:
            raise HydraulisError(f"{out}: cannot create the corpus directory: {exc.strerror or exc}") from None
        manifest = _assemble(
            tmp, build, documents, source=source, counts=counts, name=name, workers=workers
        )
        if cut is not None:
            manifest = _with_overlong(tmp, manifest, *cut)
        (tmp / OWNER_FILE).unlink()
        default_permissions(tmp)
        corpus = _publish(tmp, out, if_exists)
        build.parts.remove()
        return corpus
    except BaseException as exc:
        bad_input = isinstance(exc, HydraulisError) and not isinstance(exc, WorkerLost)
        if bad_input or not build.resumable or not build.parts.any_finished():
            build.parts.remove()  # bad input, or nothing a next build could use: no partial output
        else:
            interrupt.keep(f"{build.parts.path}: the finished parts, which the next build of {out} reuses")
        raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


class _Build:
    """What a worker needs to turn chunk k into part k (inherited by the forked workers, never pickled)."""

    def __init__(self, parts: PartsDir, tok: Tokenizer, dtype: np.dtype, skip_bad: bool, resumable: bool) -> None:
        self.parts = parts
        self.tok = tok
        self.dtype = dtype
        self.skip_bad = skip_bad
        self.resumable = resumable
        self.reused = 0

    def encode(self, item: tuple[int, list[Sample] | None]) -> Part:
        k, chunk = item
        if chunk is None:  # finished by an earlier build
            part = self.parts.finished(k)
            assert part is not None
            return part
        counts = ReadCounts()
        encoded = encode_samples(chunk, self.tok, counts, self.skip_bad, self.dtype)
        changed = {f: v for f, v in counts.freeze().to_dict().items() if v}
        return self.parts.write(k, encoded, changed)

    def items(self, documents: Iterable[Sample]) -> Iterator[tuple[int, list[Sample] | None]]:
        """(k, chunk k), or (k, None) for a part an earlier build finished."""
        for k, chunk in enumerate(_chunks(documents)):
            if self.parts.finished(k) is not None:
                self.reused += 1
                yield k, None
            else:
                yield k, chunk


class _Writer:
    """tokens.bin and mask.bin as the parts arrive, hashed on the way."""

    def __init__(self, tmp: Path, stack: contextlib.ExitStack) -> None:
        self.tmp = tmp
        self.stack = stack
        self.tokens = stack.enter_context((tmp / TOKENS_FILE).open("wb"))
        self.tokens_hash = hashlib.sha256()
        self.mask_hash = hashlib.sha256()
        self.mask: BinaryIO | None = None
        self.written = 0

    def append(self, parts: PartsDir, part: Part) -> None:
        _copy(parts.tokens_file(part.index), self.tokens, self.tokens_hash)
        if part.masked and self.mask is None:  # the first SFT record: ones for what came before
            self.mask = self.stack.enter_context((self.tmp / MASK_FILE).open("wb"))
            self._ones(self.written)
        if self.mask is not None:
            _copy(parts.mask_file(part.index), self.mask, self.mask_hash) if part.masked else self._ones(part.tokens)
        self.written += part.tokens

    def _ones(self, n: int) -> None:
        assert self.mask is not None
        for begin in range(0, n, COPY_BYTES):
            data = np.ones(min(COPY_BYTES, n - begin), dtype=np.uint8).tobytes()
            self.mask.write(data)
            self.mask_hash.update(data)

    def sync(self) -> None:
        for f in (self.tokens, self.mask):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())


def _copy(path: Path, out: BinaryIO, digest: Any) -> None:
    with path.open("rb") as src:
        while data := src.read(COPY_BYTES):
            out.write(data)
            digest.update(data)


def _assemble(
    tmp: Path, build: _Build, documents: Iterable[Sample], source: str, counts: ReadCounts, name: str, workers: int
) -> CorpusManifest:
    lengths: list[np.ndarray] = []
    targets = 0
    with contextlib.ExitStack() as stack:
        writer = _Writer(tmp, stack)
        for part in stack.enter_context(contextlib.closing(stream_map(build.encode, build.items(documents), workers))):
            writer.append(build.parts, part)
            lengths.append(part.lengths)
            targets += part.targets
            for field, value in part.counts.items():
                setattr(counts, field, getattr(counts, field) + value)
        writer.sync()
    if build.reused:
        print(f"reused {build.reused} of {len(lengths)} parts that an interrupted build finished", file=sys.stderr)
    lens = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    if not len(lens):
        raise HydraulisError(_nothing_read(source, counts.freeze()))
    return _finish(
        tmp, build, lens, writer=writer, targets=targets, source=source, counts=counts, name=name
    )


def _finish(
    tmp: Path, build: _Build, lens: np.ndarray, writer: _Writer, targets: int, source: str, counts: ReadCounts,
    name: str,
) -> CorpusManifest:  # fmt: skip
    """index.idx, then manifest.json (written last: its presence marks completeness)."""
    lens = lens.astype("<i8")
    offsets = np.zeros_like(lens)
    np.cumsum(lens[:-1], out=offsets[1:])
    total = int(lens.sum())
    index = INDEX_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, build.dtype.itemsize, len(lens), total)
    index += offsets.tobytes() + lens.tobytes()
    with (tmp / INDEX_FILE).open("wb") as fh:
        fh.write(index)
        fh.flush()
        os.fsync(fh.fileno())
    checksums = {TOKENS_FILE: writer.tokens_hash.hexdigest(), INDEX_FILE: hashlib.sha256(index).hexdigest()}
    if writer.mask is not None:
        checksums[MASK_FILE] = writer.mask_hash.hexdigest()
    tok = build.tok
    manifest = CorpusManifest(
        name=name,
        source=source,
        tokenizer=tok.name,
        vocab_size=tok.vocab_size,
        eod_id=tok.eod_id,
        dtype=build.dtype.name,
        documents=len(lens),
        tokens=total,
        max_length=int(lens.max()),
        report=counts.freeze(),
        checksums=checksums,
        tokenizer_source=getattr(tok, "source", None),
        tokenizer_sha256=tuple(getattr(tok, "sha256", ())),
        targets=targets,
        masked=writer.mask is not None,
    )
    write_json_atomic(tmp / MANIFEST_FILE, manifest.to_dict())
    return manifest


def _nothing_read(source: str, report: ReadReport) -> str:
    return (
        f"{source}: no documents to build a corpus from ({report.files} files read, "
        f"{report.empty_skipped} empty, {report.binary_skipped} binary, "
        f"{report.missing_field_skipped} without the field skipped, "
        f"{report.no_target_skipped} without a target skipped)"
    )


def _with_overlong(tmp: Path, manifest: CorpusManifest, max_len: int, policy: Policy) -> CorpusManifest:
    """The manifest with what training at max_len under `policy` cuts; refused when no target token is left."""
    corpus = open_corpus(tmp)
    cut = overlong(corpus, corpus_sampler(corpus, max_len, max_len, 0, policy))
    assert cut is not None
    check_targets_left(cut, f"--max-len {max_len} --overlong {policy}")
    manifest = replace(manifest, overlong=cut)
    write_json_atomic(tmp / MANIFEST_FILE, manifest.to_dict())
    return manifest


def _size(sample: Sample) -> int:
    """A sample's characters, what a chunk is measured in."""
    if isinstance(sample, str):
        return len(sample)
    if isinstance(sample, PromptCompletion):
        return len(sample.prompt) + len(sample.completion)
    assert isinstance(sample, Chat)
    return sum(len(m["content"]) for m in sample.messages)


def _chunks(documents: Iterable[Sample]) -> Iterator[list[Sample]]:
    chunk: list[Sample] = []
    chars = 0
    for sample in documents:
        chunk.append(sample)
        chars += _size(sample)
        if chars >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _publish(tmp: Path, out: Path, if_exists: IfExists) -> IndexedCorpus:
    """Rename the finished temporary directory into place (one rename: readers see all or nothing)."""
    if occupied(out):
        if if_exists == "keep":
            return open_corpus(out)
        if if_exists == "error":
            raise HydraulisError(f"{out}: appeared while building (pass --force to replace it)")
        replace_directory(tmp, out, old=temp_dir(out, ".old"))  # marked, so that sweeps spare it
    else:
        try:
            os.replace(tmp, out)
        except OSError:
            if out.exists() and if_exists == "keep":  # another process won the race
                return open_corpus(out)
            raise
    return open_corpus(out)

