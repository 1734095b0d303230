"""`profile = "auto"` through the real command: a second run on this machine reuses the shared cached profile."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from train_helpers import make_corpus, write_config  # noqa: E402

pytestmark = pytest.mark.dist

AUTO = {"parallel": 'pool = "1x(tp1,pp1)"\nprofile = "auto"', "train": "steps = 2"}


def test_a_second_run_reuses_the_cached_profile(tmp_path, cli, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HYDRAULIS_CACHE", str(cache))
    config = write_config(tmp_path / "run.toml", make_corpus(tmp_path / "docs"), **AUTO)
    first = cli("train", "--config", str(config), "--nproc", "1", "--out", str(tmp_path / "first"))
    assert first.returncode == 0, first.stderr
    assert "profiling tiny (tp1pp1) on 1 cpu rank(s) for the cost model:" in first.stdout
    assert "measurement steps, expected about" in first.stdout  # the time is stated before it starts
    shared = list((cache / "profiles").glob("tiny-*.json"))
    assert len(shared) == 1
    assert json.loads(shared[0].read_text()) == json.loads((tmp_path / "first" / "profile.json").read_text())
    timings = (cache / "profiles" / "timings.jsonl").read_text().splitlines()
    assert len(timings) == 1 and json.loads(timings[0])["wall_s"] > 0
    # Another run directory, the same machine and request: no profiling, the cached profile is used.
    second = cli("train", "--config", str(config), "--nproc", "1", "--out", str(tmp_path / "second"))
    assert second.returncode == 0, second.stderr
    assert "profiling tiny" not in second.stdout and f"cost model: {shared[0]}" in second.stdout, second.stdout
    assert (tmp_path / "second" / "profile.json").read_bytes() == (tmp_path / "first" / "profile.json").read_bytes()
    # Another sweep (a longer max_len) is another key: measured again, now with an estimate from the timings.
    config2 = write_config(
        tmp_path / "run2.toml", tmp_path / "docs", data='tokens_per_batch = 1024\nmax_len = 512\ntokenizer = "bytes"',
        **AUTO,
    )  # fmt: skip
    third = cli("train", "--config", str(config2), "--nproc", "1", "--out", str(tmp_path / "third"))
    assert third.returncode == 0, third.stderr
    assert "from earlier profiles on this machine" in third.stdout, third.stdout
    assert len(list((cache / "profiles").glob("tiny-*.json"))) == 2
