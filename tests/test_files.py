"""Reading and writing files (files.py: text, JSON formats, outputs): one clear error naming the file."""

from __future__ import annotations

import json

import pytest

from hydraulis.errors import HydraulisError
from hydraulis.files import (
    Fields,
    OutputSet,
    load_json,
    read_json_object,
    read_text,
    replace_directory,
    sha256_file,
    write_json_atomic,
    write_text_atomic,
)


def test_load_json_checks_the_schema_and_names_the_file(tmp_path):
    path = tmp_path / "a.json"
    write_json_atomic(path, {"schema": "x/1", "n": 3})
    assert load_json(path, "x/1")["n"] == 3
    with pytest.raises(HydraulisError, match=r"a\.json: schema is 'x/1', expected 'y/1'"):
        load_json(path, "y/1")
    path.write_text("[1, 2]")
    with pytest.raises(HydraulisError, match="expected a JSON object with schema 'x/1'"):
        load_json(path, "x/1")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{oops", r"not valid JSON \(line 1"),
        ('{"a": NaN}', "NaN is not a number JSON allows"),
        ("[]", "expected a JSON object"),
    ],
)
def test_read_json_object_raises_one_error(tmp_path, text, needle):
    path = tmp_path / "f.json"
    path.write_text(text)
    with pytest.raises(HydraulisError, match=needle):
        read_json_object(path)


def test_missing_files_say_what_they_are(tmp_path):
    with pytest.raises(HydraulisError, match="no such file"):
        read_json_object(tmp_path / "none.json")
    with pytest.raises(HydraulisError, match="not a model directory"):
        read_text(tmp_path / "config.json", missing="not a model directory")


def test_fields_name_the_field(tmp_path):
    f = Fields({"n": -1, "s": 3, "o": {"k": "v"}}, "where")
    with pytest.raises(HydraulisError, match="where.n"):
        f.int("n", minimum=0)
    with pytest.raises(HydraulisError, match="where.s"):
        f.str("s")
    assert f.obj("o").str("k") == "v"


def test_atomic_writes_leave_no_temporary(tmp_path):
    write_text_atomic(tmp_path / "sub" / "t.txt", "hello")
    write_json_atomic(tmp_path / "j.json", {"a": 1})
    assert (tmp_path / "sub" / "t.txt").read_text() == "hello"
    assert json.loads((tmp_path / "j.json").read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["j.json", "sub", "t.txt"]


def test_a_failed_output_set_publishes_nothing(tmp_path):
    with pytest.raises(RuntimeError), OutputSet() as outputs:
        outputs.stage(tmp_path / "new" / "a.txt").write_text("a")
        raise RuntimeError("fails before the end")
    assert list(tmp_path.iterdir()) == []


def test_replace_directory_swaps_whole_directories(tmp_path):
    out, tmp = tmp_path / "out", tmp_path / ".out.tmp"
    tmp.mkdir()
    (tmp / "a").write_text("1")
    replace_directory(tmp, out)
    new = tmp_path / ".out.tmp2"
    new.mkdir()
    (new / "b").write_text("2")
    replace_directory(new, out)
    assert sorted(p.name for p in out.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing left aside


def test_sha256_file(tmp_path):
    path = tmp_path / "x"
    path.write_bytes(b"abc")
    assert sha256_file(path) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
