"""Sources: which files a source path holds, read each by its kind, and sources built into the cache.

- `read_source`: `.jsonl`/`.ndjson` files as jsonl and `.parquet`/`.arrow`
  files and `datasets` directories as rows (readers.py, columnar.py), every
  other file as one document; a directory's files in sorted order.
- `ensure_source`: a jsonl, parquet or arrow file or a `datasets` directory
  given where a built corpus is expected (`[data] corpus`) is built into the
  cache once, under a name that holds its path, size, modification time and
  tokenizer, and reused until the file changes; a line says which happened.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from hydraulis.data.build.corpus import build_corpus
from hydraulis.data.build.staging import cache_dir
from hydraulis.data.columnar import datasets_files, is_columnar, read_columnar
from hydraulis.data.indexed import IndexedCorpus, open_corpus
from hydraulis.data.readers import InputOptions, Progress, ReadCounts, is_jsonl, read_jsonl, read_text_file
from hydraulis.data.records import Sample, SkippableRecord
from hydraulis.data.tokenizer import get_tokenizer
from hydraulis.errors import HydraulisError
from hydraulis.files import not_found
from hydraulis.progress import byte_progress


def list_files(root: Path, glob: str) -> list[Path]:
    """The files a directory source contributes, sorted, hidden files and folders left out."""
    if not glob:
        raise HydraulisError("--glob must not be empty")
    if Path(glob).is_absolute() or ".." in Path(glob).parts:
        raise HydraulisError(f"--glob {glob!r} must be a pattern inside the directory {root}, e.g. '**/*.txt'")
    files = []
    try:
        for p in root.glob(glob):
            rel = p.relative_to(root).parts
            if p.is_file() and not any(part.startswith(".") for part in rel):
                files.append(p)
    except (ValueError, NotImplementedError) as exc:  # pathlib's own refusal of a malformed pattern
        raise HydraulisError(f"--glob {glob!r}: {exc}; give a pattern such as '**/*.txt'") from None
    return sorted(files)


def source_files(source: Path, options: InputOptions) -> list[Path]:
    """The input files of a source path (a file, or a directory's files matching the glob)."""
    if source.is_file():
        return [source]
    if source.is_dir():
        arrow = datasets_files(source)
        if arrow is not None:
            return arrow
        files = list_files(source, options.glob)
        if not files:
            raise HydraulisError(f"{source}: no files match {options.glob!r}")
        return files
    raise HydraulisError(not_found(source, "no such file or directory"))


def read_source(
    source: Path, counts: ReadCounts, options: InputOptions = InputOptions(), progress: Progress | None = None
) -> Iterator[Sample]:
    """Samples of a file or directory: `.jsonl`/`.ndjson` files as jsonl, `.parquet`/`.arrow` files and
    `datasets` directories as rows (columnar.py), every other file as one document."""
    for path in source_files(source, options):
        if is_jsonl(path):
            yield from read_jsonl(path, counts, options, progress)
        elif is_columnar(path):
            yield from read_columnar(path, counts, options, progress)
        else:
            yield from read_text_file(path, counts, progress)


def source_bytes(source: Path, options: InputOptions = InputOptions()) -> int:
    """Total input size, for the progress bar."""
    return sum(p.stat().st_size for p in source_files(source, options))


def source_key(path: Path, files: list[Path]) -> str:
    """What identifies a source's contents: its path, and its files' names, sizes and modification times."""
    return f"{path.resolve()}: " + ", ".join(f"{p.name} {p.stat().st_size} {p.stat().st_mtime_ns}" for p in files)


def is_buildable(path: Path) -> bool:
    """A source that `[data] corpus` may name directly: a jsonl, parquet or arrow file, or a datasets directory."""
    if path.is_file():
        return is_jsonl(path) or is_columnar(path)
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_source(
    path: Path, tokenizer: str, progress: bool = False, log: Callable[[str], None] | None = None,
    workers: int | None = None,
) -> IndexedCorpus:
    """The cached build of a source file or datasets directory (see the module docstring); `workers`:
    build_corpus's."""
    log = log or _stderr
    tok = get_tokenizer(tokenizer)
    key = source_key(path, source_files(path, InputOptions()))
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    out = cache_dir() / "sources" / f"{path.stem or path.name}-{digest}-{tok.name}"
    existed = out.exists()
    if existed:
        try:
            corpus = open_corpus(out)
            if corpus.manifest.source == key:
                log(f"{path}: using its build in the cache ({out})")
                return corpus
        except HydraulisError:
            pass  # damaged: built again below
    counts = ReadCounts()
    try:
        with byte_progress(source_bytes(path), f"tokenizing {path.name} ({tok.name})", enabled=progress) as advance:
            docs = read_source(path, counts, InputOptions(), advance)
            # Under torchrun every rank prepares the job: the first build to finish is the one all of them keep.
            if_exists = "replace" if existed else "keep"
            corpus = build_corpus(
                docs, out, tok, key, counts, name=path.stem or path.name, if_exists=if_exists, workers=workers,
                resume=key,
            )
    except SkippableRecord as exc:  # its flag is one of `data build`'s, not of the command that got here
        raise HydraulisError(
            f"{exc.reason}; to skip such records, build the corpus with `hydraulis data build {path} --out DIR "
            f"--tokenizer {tokenizer} {exc.flag}` and set [data] corpus = DIR"
        ) from None
    m = corpus.manifest
    left = m.report.left_out()
    log(
        f"{path}: built into the cache once ({m.documents:,} documents, {m.tokens:,} tokens, "
        f"{m.target_tokens:,} targets; {out}); later runs reuse it until the file changes"
        + (f"; left out: {left}" if left else "")
    )
    return corpus
