"""Input readers: jsonl, plain text files, directory trees.

Real inputs are messy. Rather than failing on the first odd file, the readers
repair or skip what they safely can and count every case, so the user sees
what happened to their data:

- bytes that are not UTF-8 are replaced (U+FFFD) and the document is counted;
- empty (whitespace-only) documents are skipped;
- binary files (a NUL byte in the first 8 KiB, as git decides) are skipped;
- a jsonl line without the text field is an error naming the line, or is
  skipped when the caller says so.

Malformed JSON is always an error: it means the file is not what the user
thinks it is. Files are read in sorted order so a build is reproducible.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from hydraulis.errors import HydraulisError

BINARY_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class ReadReport:
    """What the readers did with the input; stored in the corpus manifest and shown after a build."""

    files: int = 0
    documents: int = 0
    non_utf8_replaced: int = 0
    empty_skipped: int = 0
    binary_skipped: int = 0
    missing_field_skipped: int = 0
    blank_lines: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class ReadCounts:
    """The counters of a `ReadReport` while reading (the readers add to them), frozen into one at the end."""

    def __init__(self) -> None:
        for f in fields(ReadReport):
            setattr(self, f.name, 0)

    def freeze(self) -> ReadReport:
        return ReadReport(**{f.name: getattr(self, f.name) for f in fields(ReadReport)})


@dataclass(frozen=True)
class InputOptions:
    """How to read a source: the jsonl field, whether to skip lines without it, which files of a directory."""

    field: str = "text"
    skip_missing: bool = False
    glob: str = "**/*"


Progress = Callable[[int], None]  # called with the number of input bytes just consumed


def decode(data: bytes, counts: ReadCounts) -> str:
    """UTF-8, with invalid bytes replaced and counted (a stray Latin-1 byte must not abort a build)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        counts.non_utf8_replaced += 1
        return data.decode("utf-8", errors="replace")


def is_binary(data: bytes) -> bool:
    return b"\0" in data[:BINARY_SNIFF_BYTES]


def _keep(text: str, counts: ReadCounts) -> bool:
    if not text.strip():
        counts.empty_skipped += 1
        return False
    counts.documents += 1
    return True


def read_text_file(path: Path, counts: ReadCounts, progress: Progress | None = None) -> Iterator[str]:
    """One file, one document."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise HydraulisError(f"{path}: cannot read: {exc.strerror or exc}") from None
    counts.files += 1
    if progress:
        progress(len(data))
    if is_binary(data):
        counts.binary_skipped += 1
        return
    text = decode(data, counts)
    if _keep(text, counts):
        yield text


def read_jsonl(
    path: Path, counts: ReadCounts, options: InputOptions, progress: Progress | None = None
) -> Iterator[str]:
    """One JSON object per line; the document is its `options.field` string."""
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise HydraulisError(f"{path}: cannot read: {exc.strerror or exc}") from None
    counts.files += 1
    hint = " (pass --skip-missing to skip such lines)"
    with fh:
        for number, raw in enumerate(fh, start=1):
            if progress:
                progress(len(raw))
            line = decode(raw, counts).strip()
            if not line:
                counts.blank_lines += 1
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise HydraulisError(f"{path}:{number}: not valid JSON ({exc.msg}, column {exc.colno})") from None
            if not isinstance(record, dict) or options.field not in record:
                if options.skip_missing:
                    counts.missing_field_skipped += 1
                    continue
                what = "not a JSON object" if not isinstance(record, dict) else f"no field {options.field!r}"
                raise HydraulisError(f"{path}:{number}: {what}{hint}")
            text = record[options.field]
            if not isinstance(text, str):
                if options.skip_missing:
                    counts.missing_field_skipped += 1
                    continue
                raise HydraulisError(
                    f"{path}:{number}: field {options.field!r} is {type(text).__name__}, not a string{hint}"
                )
            if _keep(text, counts):
                yield text


def is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in (".jsonl", ".ndjson")


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
        files = list_files(source, options.glob)
        if not files:
            raise HydraulisError(f"{source}: no files match {options.glob!r}")
        return files
    raise HydraulisError(f"{source}: no such file or directory")


def read_source(
    source: Path, counts: ReadCounts, options: InputOptions = InputOptions(), progress: Progress | None = None
) -> Iterator[str]:
    """Documents of a file or directory: `.jsonl`/`.ndjson` files as jsonl, every other file as one document."""
    for path in source_files(source, options):
        if is_jsonl(path):
            yield from read_jsonl(path, counts, options, progress)
        else:
            yield from read_text_file(path, counts, progress)


def source_bytes(source: Path, options: InputOptions = InputOptions()) -> int:
    """Total input size, for the progress bar."""
    return sum(p.stat().st_size for p in source_files(source, options))
