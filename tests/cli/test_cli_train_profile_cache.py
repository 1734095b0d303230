"""`profile = "auto"` through the real command: a later run on this machine reuses the shared cached profile.

The cache is keyed by the model's content (its config and, with init_from, its weights' headers), not by its
name or path: a copy of the model directory elsewhere is not profiled again.
"""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from train_helpers import make_corpus, write_config  # noqa: E402

pytestmark = pytest.mark.dist

AUTO = {"parallel": 'pool = "1x(tp1,pp1)"\nprofile = "auto"', "train": "steps = 2"}


def test_a_second_run_reuses_the_cached_profile(tmp_path, cli, monkeypatch):
    from hydraulis.runtime.hf import hf_config
    from hydraulis.specs import MODELS

    cache = tmp_path / "cache"
    monkeypatch.setenv("HYDRAULIS_CACHE", str(cache))
    model = tmp_path / "models" / "tiny-llama"
    transformers.LlamaForCausalLM(hf_config(MODELS["tiny"])).save_pretrained(str(model))
    corpus = make_corpus(tmp_path / "docs")
    config = write_config(tmp_path / "run.toml", corpus, model=f'init_from = "{model}"', **AUTO)
    first = cli("train", "--config", str(config), "--nproc", "1", "--out", str(tmp_path / "first"))
    assert first.returncode == 0, first.stderr
    assert "profiling tiny-llama (tp1pp1) on 1 cpu rank(s) for the cost model:" in first.stdout
    assert "measurement steps, expected about" in first.stdout  # the time is stated before it starts
    shared = list((cache / "profiles").glob("llama-*.json"))
    assert len(shared) == 1
    assert json.loads(shared[0].read_text()) == json.loads((tmp_path / "first" / "profile.json").read_text())
    timings = (cache / "profiles" / "timings.jsonl").read_text().splitlines()
    assert len(timings) == 1 and json.loads(timings[0])["wall_s"] > 0
    # The same model copied elsewhere under another name, another run directory: no profiling, the cached one.
    copy = tmp_path / "elsewhere" / "my-copy"
    shutil.copytree(model, copy)
    config_copy = write_config(tmp_path / "copy.toml", corpus, model=f'init_from = "{copy}"', **AUTO)
    second = cli("train", "--config", str(config_copy), "--nproc", "1", "--out", str(tmp_path / "second"))
    assert second.returncode == 0, second.stderr
    assert "profiling" not in second.stdout and f"cost model: {shared[0]}" in second.stdout, second.stdout
    assert (tmp_path / "second" / "profile.json").read_bytes() == (tmp_path / "first" / "profile.json").read_bytes()
    # Another sweep (a longer max_len) is another key: measured again, now with an estimate from the timings.
    config2 = write_config(
        tmp_path / "run2.toml", tmp_path / "docs", data='tokens_per_batch = 1024\nmax_len = 512\ntokenizer = "bytes"',
        model=f'init_from = "{model}"', **AUTO,
    )  # fmt: skip
    third = cli("train", "--config", str(config2), "--nproc", "1", "--out", str(tmp_path / "third"))
    assert third.returncode == 0, third.stderr
    assert "from earlier profiles on this machine" in third.stdout, third.stdout
    assert len(list((cache / "profiles").glob("llama-*.json"))) == 2
