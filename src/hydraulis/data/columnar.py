"""Columnar inputs: parquet files, arrow files and `datasets.save_to_disk` directories, read with pyarrow.

Each is streamed a record batch at a time (parquet: `iter_batches`, arrow: a
memory-mapped IPC stream or file), reading only the columns a record needs,
so a file is never held in memory whole. A row is a record as a jsonl line
is (records.py): a text field, prompt/completion, or messages.

A file whose schema has none of the columns asked for is one error naming
its columns (the field is wrong, not a row). A `datasets` directory is the
`state.json` + arrow files `save_to_disk` writes for one split; a
DatasetDict (`dataset_dict.json`) names its splits, and the user picks one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydraulis.data.readers import InputOptions, Progress, ReadCounts, record_sample
from hydraulis.data.records import Sample
from hydraulis.errors import HydraulisError

COLUMNAR_SUFFIXES = (".parquet", ".arrow")
BATCH_ROWS = 1024
SFT_COLUMNS = ("messages", "prompt", "completion")


def is_columnar(path: Path) -> bool:
    return path.suffix.lower() in COLUMNAR_SUFFIXES


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise HydraulisError("parquet and arrow inputs need pyarrow: pip install 'hydraulis[data]'") from None
    return pyarrow


def datasets_files(root: Path) -> list[Path] | None:
    """The arrow files of a `datasets.save_to_disk` directory in order; None if `root` is not one."""
    if (root / "dataset_dict.json").is_file():
        try:
            splits = json.loads((root / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
        except (OSError, ValueError, AttributeError):
            splits = []
        names = ", ".join(str(s) for s in splits) or "?"
        example = f"{root / str(splits[0])}" if splits else f"{root}/SPLIT"
        raise HydraulisError(f"{root}: a datasets DatasetDict with splits {names}; give one split, e.g. {example}")
    state = root / "state.json"
    if not state.is_file():
        return None
    try:
        files = [root / f["filename"] for f in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HydraulisError(f"{state}: not a datasets state file ({type(exc).__name__}: {exc})") from None
    missing = [p.name for p in files if not p.is_file()]
    if missing or not files:
        raise HydraulisError(f"{root}: the datasets directory lacks its data files ({', '.join(missing) or 'none'})")
    return files


def _columns(path: Path, names: list[str], options: InputOptions) -> list[str]:
    """The columns a record needs that the file has; an error naming the file's columns if there are none."""
    wanted = {"text": [options.field], "sft": list(SFT_COLUMNS)}.get(options.format, [*SFT_COLUMNS, options.field])
    have = [c for c in wanted if c in names]
    if not have:
        what = f"no column {options.field!r}" if options.format == "text" else f"none of the columns {wanted}"
        raise HydraulisError(f"{path}: {what} (it has: {', '.join(names) or 'none'}); pass --field or --format")
    return have


def _batches(path: Path, options: InputOptions) -> Iterator[Any]:
    pa = _pyarrow()
    try:
        if path.suffix.lower() == ".parquet":
            pf = pa.parquet.ParquetFile(str(path))
            columns = _columns(path, pf.schema_arrow.names, options)
            yield from pf.iter_batches(batch_size=BATCH_ROWS, columns=columns)
            return
        source = pa.memory_map(str(path), "r")
        try:
            reader = pa.ipc.open_stream(source)  # what datasets writes
            batches = iter(reader)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        columns = _columns(path, reader.schema.names, options)
        for batch in batches:
            yield batch.select(columns)
    except (pa.ArrowException, OSError) as exc:
        kind = "parquet" if path.suffix.lower() == ".parquet" else "arrow"
        raise HydraulisError(f"{path}: not a readable {kind} file ({str(exc).splitlines()[0][:160]})") from None


def read_columnar(
    path: Path, counts: ReadCounts, options: InputOptions, progress: Progress | None = None
) -> Iterator[Sample]:
    """The samples of a parquet or arrow file, one record batch at a time."""
    counts.files += 1
    row = 0
    for batch in _batches(path, options):
        for record in batch.to_pylist():
            row += 1
            record = {k: v for k, v in record.items() if v is not None}  # a null is a missing value
            sample = record_sample(record, options, f"{path}:row {row}", counts)
            if sample is not None:
                yield sample
    if progress:
        progress(path.stat().st_size)
