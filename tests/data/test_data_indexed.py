from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from hydraulis.data.build.corpus import build_corpus
from hydraulis.data.indexed import INDEX_FILE, MANIFEST_FILE, TOKENS_FILE, open_corpus
from hydraulis.data.tokenizer import ByteTokenizer, get_tokenizer
from hydraulis.errors import HydraulisError


def leftovers(parent: Path) -> list[str]:
    """Hidden temporary entries a build may have left next to its target."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


DOCS = ["first document", "second, a bit longer document " * 20, "x", "日本語 and ümlauts", "last\n"]


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    out = tmp_path / "c"
    build_corpus(DOCS, out, "bytes", source="test")
    return out


@pytest.mark.parametrize("name", ["bytes", "gpt2"])
def test_build_and_read_back(tmp_path: Path, name: str) -> None:
    tok = get_tokenizer(name)
    corpus = build_corpus(DOCS, tmp_path / "c", name, source="unit test")
    assert len(corpus) == len(DOCS)
    assert corpus.tokens.dtype == np.uint16
    for i, text in enumerate(DOCS):
        ids = corpus[i]
        assert ids[-1] == tok.eod_id
        assert ids[:-1].tolist() == tok.encode(text).tolist()
        assert corpus.text(i) == text
    assert corpus.lengths.tolist() == [len(tok.encode(t)) + 1 for t in DOCS]
    assert corpus[-1].tolist() == corpus[len(DOCS) - 1].tolist()
    with pytest.raises(IndexError):
        corpus[len(DOCS)]
    m = corpus.manifest
    assert (m.documents, m.tokens, m.tokenizer, m.dtype, m.source) == (
        len(DOCS),
        int(corpus.lengths.sum()),
        name,
        "uint16",
        "unit test",
    )
    assert m.max_length == int(corpus.lengths.max())
    assert set(m.checksums) == {TOKENS_FILE, INDEX_FILE}
    reopened = open_corpus(tmp_path / "c", verify=True)
    assert reopened.lengths.tolist() == corpus.lengths.tolist()
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [INDEX_FILE, MANIFEST_FILE, TOKENS_FILE]
    assert leftovers(tmp_path) == []


def test_document_read_is_a_view_of_the_memory_map(corpus_dir: Path) -> None:
    corpus = open_corpus(corpus_dir)
    doc = corpus[1]
    assert isinstance(corpus.tokens, np.memmap)
    assert np.shares_memory(doc, corpus.tokens)
    assert not corpus.lengths.flags.writeable


@dataclass(frozen=True)
class WideBytes(ByteTokenizer):
    """Byte tokens, but claims a vocabulary above 65536 to exercise uint32 storage."""

    name: str = "bytes"
    vocab_size: int = 70000


def test_large_vocabulary_uses_uint32(tmp_path: Path) -> None:
    corpus = build_corpus(DOCS, tmp_path / "c", WideBytes(), source="t")
    assert corpus.tokens.dtype == np.uint32
    assert corpus.manifest.dtype == "uint32"
    assert corpus[0][:-1].tobytes() == np.frombuffer(b"first document", np.uint8).astype("<u4").tobytes()


def test_crash_while_building_leaves_nothing(tmp_path: Path) -> None:
    def docs():
        yield "one"
        yield "two"
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        build_corpus(docs(), tmp_path / "c", "bytes", source="t")
    assert not (tmp_path / "c").exists()
    assert leftovers(tmp_path) == []


def test_an_unfinished_directory_does_not_load(corpus_dir: Path) -> None:
    (corpus_dir / MANIFEST_FILE).unlink()  # as if the process died before the manifest was written
    with pytest.raises(HydraulisError, match="not a built corpus"):
        open_corpus(corpus_dir)


def test_no_documents_is_an_error_without_output(tmp_path: Path) -> None:
    with pytest.raises(HydraulisError, match="no documents"):
        build_corpus([], tmp_path / "c", "bytes", source="empty")
    assert not (tmp_path / "c").exists() and leftovers(tmp_path) == []


def test_existing_output(tmp_path: Path, corpus_dir: Path) -> None:
    with pytest.raises(HydraulisError, match="already exists"):
        build_corpus(["new"], corpus_dir, "bytes", source="t")
    assert open_corpus(corpus_dir).text(0) == DOCS[0]
    replaced = build_corpus(["new"], corpus_dir, "bytes", source="t", if_exists="replace")
    assert len(replaced) == 1 and open_corpus(corpus_dir).text(0) == "new"
    kept = build_corpus(["other"], corpus_dir, "bytes", source="t", if_exists="keep")
    assert kept.text(0) == "new"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert len(build_corpus(["a", "b"], empty, "bytes", source="t")) == 2
    assert leftovers(tmp_path) == []


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(HydraulisError, match="no such corpus directory"):
        open_corpus(tmp_path / "nope")


def _error(path: Path) -> str:
    with pytest.raises(HydraulisError) as info:
        open_corpus(path)
    return str(info.value)


def test_truncated_index_names_the_file(corpus_dir: Path) -> None:
    index = corpus_dir / INDEX_FILE
    data = index.read_bytes()
    index.write_bytes(data[:-5])
    msg = _error(corpus_dir)
    assert str(index) in msg and "truncated" in msg
    index.write_bytes(data[:10])
    msg = _error(corpus_dir)
    assert str(index) in msg and "truncated" in msg
    index.write_bytes(b"")
    assert str(index) in _error(corpus_dir)
    index.unlink()
    assert str(index) in _error(corpus_dir) and "missing" in _error(corpus_dir)


def test_corrupt_index_names_the_file(corpus_dir: Path) -> None:
    index = corpus_dir / INDEX_FILE
    data = bytearray(index.read_bytes())
    bad_magic = bytearray(data)
    bad_magic[:4] = b"XXXX"
    index.write_bytes(bytes(bad_magic))
    msg = _error(corpus_dir)
    assert str(index) in msg and "magic" in msg
    bad_length = bytearray(data)
    bad_length[-8:] = np.array([999], "<i8").tobytes()  # the last document's length
    index.write_bytes(bytes(bad_length))
    msg = _error(corpus_dir)
    assert str(index) in msg and "corrupt" in msg
    index.write_bytes(bytes(data) + b"\0" * 16)
    assert "corrupt" in _error(corpus_dir)


def test_truncated_tokens_name_the_file(corpus_dir: Path) -> None:
    tokens = corpus_dir / TOKENS_FILE
    tokens.write_bytes(tokens.read_bytes()[:-2])
    msg = _error(corpus_dir)
    assert str(tokens) in msg and "truncated" in msg


def test_manifest_disagreeing_with_index(corpus_dir: Path) -> None:
    manifest = corpus_dir / MANIFEST_FILE
    data = json.loads(manifest.read_text())
    data["documents"] += 1
    manifest.write_text(json.dumps(data))
    assert "disagrees" in _error(corpus_dir)
    manifest.write_text("{not json")
    assert str(manifest) in _error(corpus_dir)


def test_checksum_detects_changed_tokens(corpus_dir: Path) -> None:
    tokens = corpus_dir / TOKENS_FILE
    data = bytearray(tokens.read_bytes())
    data[0] ^= 1
    tokens.write_bytes(bytes(data))
    corpus = open_corpus(corpus_dir)  # sizes still agree: opening stays O(index)
    with pytest.raises(HydraulisError, match="checksum"):
        corpus.verify()
