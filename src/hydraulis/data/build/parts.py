"""A build's parts: each chunk of the input tokenized into files of its own, kept until the corpus is published.

`.NAME.parts/` next to the corpus holds `key` (the sha256 of what is being built: the source, its files'
sizes and times, the read options, the tokenizer, the chunking) and, for each finished chunk k,
`k.tokens` (and `k.mask` when it holds an SFT record) and `k.json` (its documents' lengths, targets, what
encoding changed in the readers' counts), the json renamed into place last: a part is finished when its
json is there and its files have the sizes it gives. Part files are not fsynced (a SIGKILL loses nothing
the kernel was given; the corpus itself is fsynced before it is published).

A build killed at any point leaves this directory (and the `.tmp` one it assembles the corpus in,
staging.py), neither of which `open_corpus` accepts; the next build of the corpus with the same key reuses
the finished parts, one with another key clears them. An exclusive `flock` on `lock` (the kernel releases
it when its holder dies) lets one builder at a time use the directory: torchrun's ranks preparing the same
source wait for the first and then open its corpus.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hydraulis.data.sft import EncodedChunk
from hydraulis.errors import HydraulisError
from hydraulis.files import temp_prefix, write_json_atomic

LOCK_FILE = "lock"
KEY_FILE = "key"
PARTS_VERSION = "hydraulis.parts/1"  # the part files' format; in the key, so a changed format is never reused


@dataclass(frozen=True)
class Part:
    """A finished part: its documents' lengths, targets, whether it has a mask, what encoding counted."""

    index: int
    lengths: np.ndarray  # int64
    targets: int
    masked: bool
    counts: dict[str, int]  # additions to the readers' counts (SFT records skipped after tokenization)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


class PartsDir:
    """The parts directory of one corpus, held (locked) by this builder."""

    def __init__(self, path: Path, itemsize: int) -> None:
        self.path = path
        self.itemsize = itemsize

    def tokens_file(self, k: int) -> Path:
        return self.path / f"{k}.tokens"

    def mask_file(self, k: int) -> Path:
        return self.path / f"{k}.mask"

    def finished(self, k: int) -> Part | None:
        """Part k if an earlier build finished it (its json there, its files of the sizes it gives)."""
        try:
            meta = json.loads((self.path / f"{k}.json").read_text())
            part = Part(k, np.asarray(meta["lengths"], dtype=np.int64), int(meta["targets"]), bool(meta["masked"]),
                        {str(c): int(v) for c, v in meta["counts"].items()})  # fmt: skip
            sizes_ok = self.tokens_file(k).stat().st_size == part.tokens * self.itemsize
            if part.masked:
                sizes_ok = sizes_ok and self.mask_file(k).stat().st_size == part.tokens
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return part if sizes_ok else None

    def write(self, k: int, chunk: EncodedChunk, counts: dict[str, int]) -> Part:
        """Part k's files, its json last (written and renamed atomically: the mark that the part is finished)."""
        chunk.tokens.tofile(self.tokens_file(k))
        if chunk.mask is not None:
            chunk.mask.tofile(self.mask_file(k))
        part = Part(k, chunk.lengths, chunk.targets, chunk.mask is not None, counts)
        meta = {"lengths": chunk.lengths.tolist(), "targets": chunk.targets, "masked": part.masked, "counts": counts}
        write_json_atomic(self.path / f"{k}.json", meta)
        return part

    def start(self, key: str | None) -> bool:
        """Keep the parts of an earlier build with this key (True), else clear the directory for this one."""
        digest = hashlib.sha256(f"{PARTS_VERSION}\n{key}".encode()).hexdigest() if key is not None else None
        try:
            if digest is not None and (self.path / KEY_FILE).read_text() == digest:
                return True
        except OSError:
            pass
        for p in self.path.iterdir():
            if p.name != LOCK_FILE:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        if digest is not None:
            (self.path / KEY_FILE).write_text(digest)
        return False

    def any_finished(self) -> bool:
        return any(self.path.glob("*.json"))

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@contextmanager
def held_parts(out: Path, itemsize: int) -> Iterator[PartsDir]:
    """The parts directory of the corpus at `out`, locked for this builder until the block ends (one that
    another builder removed while this one waited is made again)."""
    path = out.parent / f"{temp_prefix(out.name)}parts"
    while True:
        try:
            path.mkdir(exist_ok=True)
            fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise HydraulisError(f"{out}: cannot create the corpus directory: {exc.strerror or exc}") from None
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.fstat(fd).st_ino == os.stat(path / LOCK_FILE).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield PartsDir(path, itemsize)
    finally:
        os.close(fd)
