"""Input readers: jsonl, plain text files, directory trees (parquet, arrow and `datasets`: columnar.py).

Real inputs are messy. Rather than failing on the first odd file, the readers
repair or skip what they safely can and count every case, so the user sees
what happened to their data:

- bytes that are not UTF-8 are replaced (U+FFFD) and the document is counted;
- empty (whitespace-only) documents are skipped;
- binary files (a NUL byte in the first 8 KiB, as git decides) are skipped;
- a jsonl line without the text field (or, for SFT data, without
  prompt/completion or messages: records.py) is an error naming the line,
  or is skipped and counted when the caller says so.

Malformed JSON is always an error: it means the file is not what the user
thinks it is. Files are read in sorted order so a build is reproducible.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from hydraulis.data.records import BadRecord, Format, Sample, SkippableRecord, parse_record
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
    sft_records: int = 0  # prompt/completion and chat records among the documents
    no_target_skipped: int = 0  # SFT records with nothing to learn after tokenization (--skip-bad)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def left_out(self) -> str:
        """What the readers made no document of, in words ('' when nothing): why a source of N records or lines
        holds fewer documents."""
        counts = ((self.empty_skipped, "empty"), (self.binary_skipped, "binary"),
                  (self.missing_field_skipped, "without the field"), (self.blank_lines, "blank line(s)"),
                  (self.no_target_skipped, "without a target"))
        return ", ".join(f"{n:,} {what}" for n, what in counts if n)


class ReadCounts:
    """The counters of a `ReadReport` while reading (the readers add to them), frozen into one at the end."""

    def __init__(self) -> None:
        for f in fields(ReadReport):
            setattr(self, f.name, 0)

    def freeze(self) -> ReadReport:
        return ReadReport(**{f.name: getattr(self, f.name) for f in fields(ReadReport)})


@dataclass(frozen=True)
class InputOptions:
    """How to read a source: the record field and format, whether to skip records without them, which files."""

    field: str = "text"
    skip_missing: bool = False
    glob: str = "**/*"
    format: Format = "auto"


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
    if not text or text.isspace():  # as `not text.strip()`, without copying the text
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
) -> Iterator[Sample]:
    """One JSON object per line: a document (its `options.field` string) or an SFT record (records.py)."""
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise HydraulisError(f"{path}: cannot read: {exc.strerror or exc}") from None
    counts.files += 1
    with fh:
        for number, raw in enumerate(fh, start=1):
            if progress:
                progress(len(raw))
            if raw.isspace() or not raw:
                counts.blank_lines += 1
                continue
            try:  # the bytes as they are (json decodes UTF-8 itself); what is not UTF-8 is replaced and counted
                try:
                    record = json.loads(raw)
                except UnicodeDecodeError:
                    record = json.loads(decode(raw, counts))
            except json.JSONDecodeError as exc:
                raise HydraulisError(f"{path}:{number}: not valid JSON ({exc.msg}, column {exc.colno})") from None
            sample = record_sample(record, options, f"{path}:{number}", counts)
            if sample is not None:
                yield sample


def record_sample(record: object, options: InputOptions, where: str, counts: ReadCounts) -> Sample | None:
    """A record's sample (counted), or None when it is skipped (empty text, missing field with skip_missing)."""
    try:
        sample = parse_record(record, options.field, options.format, where)
    except BadRecord as exc:
        if options.skip_missing:
            counts.missing_field_skipped += 1
            return None
        raise SkippableRecord(str(exc), "--skip-missing") from None
    if isinstance(sample, str):
        return sample if _keep(sample, counts) else None
    counts.documents += 1
    counts.sft_records += 1
    return sample


def is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in (".jsonl", ".ndjson")
