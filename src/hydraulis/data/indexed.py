"""Indexed corpora: tokens in one memory-mapped file, plus an index of document offsets and lengths.

A corpus is a directory:

    tokens.bin     every document's tokens followed by the end-of-document token,
                   back to back, little-endian uint16 (vocabulary <= 65536) or uint32
    index.idx      32-byte header (magic, version, token size, documents, tokens),
                   then int64 offsets[documents], then int64 lengths[documents]
    manifest.json  `hydraulis.corpus/1`: source, tokenizer, counts, what the readers
                   skipped or repaired, and sha256 checksums of both files

Reading a document is O(1): a slice of the memory map at its offset. Lengths
(what the planner needs) come from the index without touching the tokens.

The builder streams: documents are tokenized in chunks and appended, so memory
stays bounded by the chunk, not the corpus. It writes into a hidden temporary
directory next to the target and renames it into place only when everything,
manifest last, is written: a crash leaves no directory that `open_corpus` accepts.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from hydraulis.data.readers import ReadCounts, ReadReport
from hydraulis.data.tokenizer import Tokenizer, get_tokenizer, token_dtype
from hydraulis.errors import HydraulisError
from hydraulis.files import default_mode, replace_directory, sha256_file, temp_prefix
from hydraulis.jsonio import Fields, load_json, write_json_atomic

CORPUS_SCHEMA = "hydraulis.corpus/1"
TOKENS_FILE = "tokens.bin"
INDEX_FILE = "index.idx"
MANIFEST_FILE = "manifest.json"
INDEX_MAGIC = b"HYDIDX\x00\x01"
INDEX_VERSION = 1
INDEX_HEADER = struct.Struct("<8sIIQQ")  # magic, version, token itemsize, documents, tokens
CHUNK_CHARS = 4_000_000  # characters tokenized at once: bounds memory, keeps tiktoken's threads busy
CHUNK_DOCS = 1024

IfExists = Literal["error", "replace", "keep"]


@dataclass(frozen=True)
class CorpusManifest:
    """What a corpus holds and where it came from (manifest.json)."""

    name: str
    source: str
    tokenizer: str
    vocab_size: int
    eod_id: int
    dtype: str
    documents: int
    tokens: int
    max_length: int
    report: ReadReport
    checksums: dict[str, str]
    eod_appended: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": CORPUS_SCHEMA,
            "name": self.name,
            "source": self.source,
            "tokenizer": {"name": self.tokenizer, "vocab_size": self.vocab_size, "eod_id": self.eod_id},
            "dtype": self.dtype,
            "eod_appended": self.eod_appended,
            "documents": self.documents,
            "tokens": self.tokens,
            "max_length": self.max_length,
            "input": self.report.to_dict(),
            "sha256": dict(self.checksums),
        }

    @classmethod
    def load(cls, path: Path) -> CorpusManifest:
        data = load_json(path, CORPUS_SCHEMA)
        f = Fields(data, str(path))
        tok = f.obj("tokenizer")
        inp = f.obj("input")
        sums = f.obj("sha256")
        report = ReadReport(**{k: inp.int(k, default=0, minimum=0) for k in ReadReport().to_dict()})
        dtype = f.str("dtype")
        if dtype not in ("uint16", "uint32"):
            raise HydraulisError(f"{path}.dtype: expected uint16 or uint32, got {dtype!r}")
        eod = data.get("eod_appended", True)
        if not isinstance(eod, bool):
            raise HydraulisError(f"{path}.eod_appended: expected true or false, got {eod!r}")
        return cls(
            name=f.str("name"),
            source=f.str("source"),
            tokenizer=tok.str("name"),
            vocab_size=tok.int("vocab_size", minimum=1),
            eod_id=tok.int("eod_id", minimum=0),
            dtype=dtype,
            documents=f.int("documents", minimum=1),
            tokens=f.int("tokens", minimum=1),
            max_length=f.int("max_length", minimum=1),
            report=report,
            checksums={TOKENS_FILE: sums.str(TOKENS_FILE), INDEX_FILE: sums.str(INDEX_FILE)},
            eod_appended=eod,
        )


class IndexedCorpus:
    """A built corpus, opened read-only. `corpus[i]` is document i's tokens (a memory-map view, no copy)."""

    def __init__(
        self, path: Path, manifest: CorpusManifest, tokens: np.ndarray, offsets: np.ndarray, lengths: np.ndarray
    ):
        self.path = path
        self.manifest = manifest
        self.tokens = tokens
        self.offsets = offsets
        self.lengths = lengths  # int64, one per document, end-of-document token included

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
        if self.manifest.eod_appended:
            tokens = tokens[:-1]
        return get_tokenizer(self.manifest.tokenizer).decode(tokens)

    def verify(self) -> None:
        """Recompute both checksums (reads every byte); raise if the files changed since the build."""
        for name, expected in self.manifest.checksums.items():
            if _sha256_file(self.path / name) != expected:
                raise HydraulisError(f"{self.path / name}: checksum differs from {self.path / MANIFEST_FILE}")


def open_corpus(path: str | Path, verify: bool = False) -> IndexedCorpus:
    """Open a built corpus; a missing, truncated or inconsistent file is an error that names it."""
    path = Path(path)
    if not path.is_dir():
        raise HydraulisError(f"{path}: no such corpus directory")
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
    corpus = IndexedCorpus(path, manifest, tokens, offsets, lengths)
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


def build_corpus(
    documents: Iterable[str],
    out: str | Path,
    tokenizer: Tokenizer | str,
    source: str,
    counts: ReadCounts | None = None,
    name: str | None = None,
    if_exists: IfExists = "error",
) -> IndexedCorpus:
    """Tokenize documents into a corpus directory at `out`, atomically.

    `counts` is the readers' counter object (filled while `documents` is
    consumed); its final state goes into the manifest. `if_exists` says what
    to do when `out` already exists: fail, replace it, or keep it (used by the
    built-in cache when two processes build the same corpus at once).
    """
    out = Path(out)
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    counts = counts if counts is not None else ReadCounts()
    if out.exists() and not out.is_dir():
        raise HydraulisError(f"{out}: exists and is not a directory")
    if _occupied(out) and if_exists == "error":
        raise HydraulisError(f"{out}: already exists (pass --force to replace it)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        swept = sweep_temporaries(out)
        tmp = _temp_dir(out, ".tmp")
    except OSError as exc:
        raise HydraulisError(f"{out}: cannot create the corpus directory: {exc.strerror or exc}") from None
    if swept:
        print(
            f"removed {swept} temporary director{'y' if swept == 1 else 'ies'} left by an interrupted build of {out}",
            file=sys.stderr,
        )
    try:
        manifest = _write(tmp, documents, tok, source, counts, name or out.name)
        (tmp / OWNER_FILE).unlink()
        _default_permissions(tmp)
        return _publish(tmp, out, if_exists, manifest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write(tmp: Path, documents: Iterable[str], tok: Tokenizer, source: str, counts: ReadCounts, name: str):
    dtype = token_dtype(tok.vocab_size)
    eod = np.array([tok.eod_id], dtype=dtype)
    lengths: list[int] = []
    tokens_hash = hashlib.sha256()
    with (tmp / TOKENS_FILE).open("wb") as fh:
        for texts in _chunks(documents):
            for ids in tok.encode_batch(texts):
                arr = np.concatenate([ids.astype(dtype), eod])
                data = arr.tobytes()
                fh.write(data)
                tokens_hash.update(data)
                lengths.append(len(arr))
        fh.flush()
        os.fsync(fh.fileno())
    if not lengths:
        report = counts.freeze()
        raise HydraulisError(
            f"{source}: no documents to build a corpus from ({report.files} files read, "
            f"{report.empty_skipped} empty, {report.binary_skipped} binary, "
            f"{report.missing_field_skipped} without the field skipped)"
        )
    lens = np.asarray(lengths, dtype="<i8")
    offsets = np.zeros_like(lens)
    np.cumsum(lens[:-1], out=offsets[1:])
    total = int(lens.sum())
    index = INDEX_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, dtype.itemsize, len(lens), total)
    index += offsets.tobytes() + lens.tobytes()
    with (tmp / INDEX_FILE).open("wb") as fh:
        fh.write(index)
        fh.flush()
        os.fsync(fh.fileno())
    manifest = CorpusManifest(
        name=name,
        source=source,
        tokenizer=tok.name,
        vocab_size=tok.vocab_size,
        eod_id=tok.eod_id,
        dtype=dtype.name,
        documents=len(lens),
        tokens=total,
        max_length=int(lens.max()),
        report=counts.freeze(),
        checksums={TOKENS_FILE: tokens_hash.hexdigest(), INDEX_FILE: hashlib.sha256(index).hexdigest()},
    )
    write_json_atomic(tmp / MANIFEST_FILE, manifest.to_dict())  # written last: its presence marks completeness
    return manifest


def _chunks(documents: Iterable[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    chars = 0
    for text in documents:
        chunk.append(text)
        chars += len(text)
        if chars >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _publish(tmp: Path, out: Path, if_exists: IfExists, manifest: CorpusManifest) -> IndexedCorpus:
    """Rename the finished temporary directory into place (one rename: readers see all or nothing)."""
    if _occupied(out):
        if if_exists == "keep":
            return open_corpus(out)
        if if_exists == "error":
            raise HydraulisError(f"{out}: appeared while building (pass --force to replace it)")
        replace_directory(tmp, out, old=_temp_dir(out, ".old"))  # marked, so that sweeps spare it
    else:
        try:
            os.replace(tmp, out)
        except OSError:
            if out.exists() and if_exists == "keep":  # another process won the race
                return open_corpus(out)
            raise
    return open_corpus(out)


OWNER_FILE = ".owner"  # the building process's id, inside each temporary directory


def _temp_dir(out: Path, suffix: str) -> Path:
    """`.NAME.XXXX.tmp` (or `.old`) next to `out`, marked with our pid so that sweeps spare it while we live."""
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out.name), suffix=suffix, dir=out.parent))
    (tmp / OWNER_FILE).write_text(str(os.getpid()))
    return tmp


def sweep_temporaries(out: Path) -> int:
    """Remove the temporary directories of builds of `out` whose process is gone (SIGKILL, power loss)."""
    swept = 0
    for p in out.parent.glob(f"{glob.escape(temp_prefix(out.name))}*"):
        if p.suffix not in (".tmp", ".old") or not p.is_dir() or p.is_symlink():
            continue
        try:
            pid = int((p / OWNER_FILE).read_text())
        except (OSError, ValueError):
            pid = None  # from a build that died before marking it
        if pid is not None and _alive(pid):
            continue
        shutil.rmtree(p, ignore_errors=True)
        swept += not p.exists()
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return True


def _default_permissions(tmp: Path) -> None:
    """A corpus directory and its files get the usual umask-based modes."""
    default_mode(tmp)
    for p in tmp.iterdir():
        default_mode(p)


def _occupied(out: Path) -> bool:
    """An existing non-empty directory (an empty one, e.g. made by the user beforehand, is fair game)."""
    return out.is_dir() and any(out.iterdir())


def _sha256_file(path: Path) -> str:
    try:
        return sha256_file(path)
    except FileNotFoundError:
        raise HydraulisError(f"{path}: missing (rebuild the corpus)") from None


@contextlib.contextmanager
def byte_progress(total: int, description: str, enabled: bool = True) -> Iterator[Callable[[int], None] | None]:
    """A rich progress bar on stderr over input bytes; None (no bar) when disabled or rich is missing."""
    if not enabled:
        yield None
        return
    try:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:
        yield None
        return
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)
