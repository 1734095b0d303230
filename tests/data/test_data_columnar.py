"""Parquet, arrow and `datasets` directories: the same samples as jsonl, streamed; a source as [data] corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import one_line_error
from test_data_cli import hidden

from hydraulis.data.columnar import read_columnar
from hydraulis.data.readers import InputOptions, ReadCounts
from hydraulis.data.sources import read_source
from hydraulis.errors import HydraulisError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
ipc = pytest.importorskip("pyarrow.ipc")

RECORDS = [
    {"text": "a plain document", "prompt": None, "completion": None, "messages": None},
    {"text": None, "prompt": "Q: two plus two?", "completion": " four", "messages": None},
    {
        "text": None,
        "prompt": None,
        "completion": None,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    },
    {"text": "ünïcode and more", "prompt": None, "completion": None, "messages": None},
]


def jsonl_of(records: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in records))
    return path


def samples(path: Path, **options: object) -> list:
    return list(read_source(path, ReadCounts(), InputOptions(**options)))  # type: ignore[arg-type]


def write_arrow(table, path: Path, stream: bool) -> Path:  # noqa: ANN001
    with pa.OSFile(str(path), "wb") as sink:
        writer = (ipc.new_stream if stream else ipc.new_file)(sink, table.schema)
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)
        writer.close()
    return path


def test_rows_are_the_records_of_jsonl(tmp_path: Path) -> None:
    table = pa.Table.from_pylist(RECORDS)
    want = samples(jsonl_of(RECORDS, tmp_path / "r.jsonl"))
    assert len(want) == 4 and isinstance(want[0], str)
    pq.write_table(table, tmp_path / "r.parquet", row_group_size=2)
    assert samples(tmp_path / "r.parquet") == [_at(s, tmp_path / "r.parquet", i) for i, s in enumerate(want)]
    for stream in (True, False):
        path = write_arrow(table, tmp_path / f"r{stream}.arrow", stream)
        assert samples(path) == [_at(s, path, i) for i, s in enumerate(want)]


def _at(sample, path: Path, i: int):  # noqa: ANN001, ANN202
    """The jsonl sample as the columnar reader names its place (path:row N instead of path:line N)."""
    from dataclasses import replace

    return sample if isinstance(sample, str) else replace(sample, where=f"{path}:row {i + 1}")


def test_datasets_directory(tmp_path: Path) -> None:
    """The layout `Dataset.save_to_disk` writes: arrow stream shards listed in state.json."""
    table = pa.Table.from_pylist([{"text": f"document number {i}"} for i in range(7)])
    root = tmp_path / "ds"
    root.mkdir()
    write_arrow(table.slice(0, 4), root / "data-00000-of-00002.arrow", stream=True)
    write_arrow(table.slice(4), root / "data-00001-of-00002.arrow", stream=True)
    files = [{"filename": "data-00000-of-00002.arrow"}, {"filename": "data-00001-of-00002.arrow"}]
    (root / "state.json").write_text(json.dumps({"_data_files": files, "_split": "train"}))
    (root / "dataset_info.json").write_text("{}")
    assert samples(root) == [f"document number {i}" for i in range(7)]
    (tmp_path / "dict").mkdir()
    (tmp_path / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(HydraulisError, match=r"DatasetDict with splits train, test; give one split, e\.g\. .*train"):
        samples(tmp_path / "dict")


def test_parquet_is_streamed_a_batch_at_a_time(tmp_path: Path) -> None:
    """Arrow's allocator never holds more than a few batches, far below the file's 10 MB of text."""
    text = "x" * 500
    table = pa.Table.from_pylist([{"text": f"{i} {text}", "other": i} for i in range(20_000)])
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=1000)
    del table
    base = pa.total_allocated_bytes()
    peak, count = 0, 0
    for _ in read_columnar(tmp_path / "big.parquet", ReadCounts(), InputOptions()):
        count += 1
        peak = max(peak, pa.total_allocated_bytes() - base)
    assert count == 20_000
    print(f"\npeak arrow memory while reading 10 MB of parquet text: {peak / 1e6:.2f} MB")
    assert peak < 4_000_000  # reading the file whole holds over 10 MB


def test_a_parquet_file_without_the_field_is_one_line(cli, tmp_path: Path) -> None:  # noqa: ANN001
    pq.write_table(pa.Table.from_pylist([{"body": "text", "id": 1}]), tmp_path / "x.parquet")
    out = tmp_path / "out"
    msg = one_line_error(cli("data", "build", str(tmp_path / "x.parquet"), "--out", str(out), "-t", "bytes"))
    assert "x.parquet: none of the columns" in msg and "it has: body, id" in msg and "--field" in msg
    msg = one_line_error(
        cli("data", "build", str(tmp_path / "x.parquet"), "--out", str(out), "-t", "bytes", "--format", "text")
    )
    assert "x.parquet: no column 'text' (it has: body, id)" in msg
    assert not out.exists() and hidden(tmp_path) == []
    res = cli("data", "build", str(tmp_path / "x.parquet"), "--out", str(out), "-t", "bytes", "--field", "body")
    assert res.returncode == 0, res.stderr
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    msg = one_line_error(
        cli("data", "build", str(tmp_path / "bad.parquet"), "--out", str(tmp_path / "o2"), "-t", "bytes")
    )
    assert "bad.parquet: not a readable parquet file" in msg


def test_a_jsonl_corpus_in_the_config_is_built_once_and_reused(tmp_path: Path) -> None:
    from hydraulis.training.config import parse_config
    from hydraulis.training.job import prepare

    src = jsonl_of([{"text": f"document {i} " * (1 + i % 7)} for i in range(60)], tmp_path / "data.jsonl")
    said: list[str] = []

    def run(name: str):  # noqa: ANN202
        config = parse_config(
            {
                "model": {"preset": "tiny"},
                "data": {"corpus": str(src), "tokenizer": "bytes", "tokens_per_batch": 512, "max_len": 128},
                "parallel": {"pool": "1x(tp1,pp1)"},
            }
        )
        return prepare(config, nproc=1, out=str(tmp_path / name), steps=1, resume=False, log=log)

    def log(line: str) -> None:  # the corpus's lines; the run's first lines on its profile are another test's
        if not line.startswith(("profile: ", "refit: ")):
            said.append(line)

    first = run("a")
    assert len(said) == 1 and "data.jsonl: built into the cache once (60 documents" in said[0]
    second = run("b")
    assert said[1] == f"{src}: using its build in the cache ({first.data.corpus_path})"
    assert second.data.corpus_path == first.data.corpus_path
    src.write_text(src.read_text() + json.dumps({"text": "one more"}) + "\n")
    third = run("c")
    assert "built into the cache once (61 documents" in said[2] and third.data.corpus_path != first.data.corpus_path
