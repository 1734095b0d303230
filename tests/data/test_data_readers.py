from __future__ import annotations

from pathlib import Path

import pytest

from hydraulis.data.readers import InputOptions, ReadCounts
from hydraulis.data.sources import read_source
from hydraulis.errors import HydraulisError


def read(source: Path, **options) -> tuple[list[str], ReadCounts]:
    counts = ReadCounts()
    docs = list(read_source(source, counts, InputOptions(**options)))
    return docs, counts


def test_jsonl_field_option(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"body": "one", "id": 1}\n\n{"body": "two"}\n', encoding="utf-8")
    docs, counts = read(path, field="body")
    assert docs == ["one", "two"]
    assert (counts.files, counts.documents, counts.blank_lines) == (1, 2, 1)


def test_jsonl_missing_field_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n\n{"other": 3}\n{"text": "five"}\n', encoding="utf-8")
    with pytest.raises(HydraulisError, match=r"a\.jsonl:4: no field 'text'.*\(pass --skip-missing"):
        read(path)
    docs, counts = read(path, skip_missing=True)
    assert docs == ["one", "two", "five"]
    assert counts.missing_field_skipped == 1


def test_jsonl_field_of_the_wrong_type(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "one"}\n{"text": null}\n[1, 2]\n', encoding="utf-8")
    with pytest.raises(HydraulisError, match=r"a\.jsonl:2: field 'text' is NoneType, not a string"):
        read(path)
    docs, counts = read(path, skip_missing=True)
    assert docs == ["one"] and counts.missing_field_skipped == 2


def test_jsonl_invalid_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "one"}\n{"text": "tw\n', encoding="utf-8")
    with pytest.raises(HydraulisError, match=r"a\.jsonl:2: not valid JSON"):
        read(path, skip_missing=True)


def test_non_utf8_is_replaced_and_counted(tmp_path: Path) -> None:
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    docs, counts = read(tmp_path)
    assert docs == ["ok", "caf\ufffd", "caf\ufffd"]
    assert counts.non_utf8_replaced == 2


def test_empty_and_binary_files_are_skipped_and_counted(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("real text", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    (tmp_path / "blank.txt").write_text(" \n\t\n", encoding="utf-8")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    (tmp_path / "c.jsonl").write_text('{"text": ""}\n{"text": "x"}\n', encoding="utf-8")
    docs, counts = read(tmp_path)
    assert docs == ["real text", "x"]
    assert (counts.files, counts.documents, counts.empty_skipped, counts.binary_skipped) == (5, 2, 3, 1)


def test_directory_glob_sorted_and_hidden_left_out(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.md").write_text("two", encoding="utf-8")
    (tmp_path / "a.md").write_text("one", encoding="utf-8")
    (tmp_path / "notes.txt").write_text("not markdown", encoding="utf-8")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.md").write_text("hidden", encoding="utf-8")
    docs, _ = read(tmp_path, glob="**/*.md")
    assert docs == ["one", "two"]
    with pytest.raises(HydraulisError, match=r"no files match '\*\.rst'"):
        read(tmp_path, glob="*.rst")


def test_missing_source(tmp_path: Path) -> None:
    with pytest.raises(HydraulisError, match="no such file or directory"):
        read(tmp_path / "nope.jsonl")
