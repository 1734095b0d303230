"""`hydraulis train` through the real command: outputs, deployment-independent losses, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from train_helpers import losses, make_corpus, write_config  # noqa: E402

pytestmark = pytest.mark.dist

@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "docs")


@pytest.fixture(scope="module")
def hetero_run(tmp_path_factory, corpus, session_cli):
    tmp = tmp_path_factory.mktemp("hetero")
    config = write_config(tmp / "run.toml", corpus)
    result = session_cli("train", "--config", str(config), "--nproc", "4", "--out", str(tmp / "out"), timeout=300)
    return result, tmp / "out"


def test_train_writes_the_run_directory(hetero_run):
    result, out = hetero_run
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps, summary = rows[:-1], rows[-1]["summary"]
    assert [r["step"] for r in steps] == list(range(6))
    for key in ("loss", "tokens", "deployment", "iteration_s", "predicted_s", "planning_s", "lr", "grad_norm",
                "replica_s"):
        assert all(key in r for r in steps), key
    assert all(len(r["replica_s"]) == len(r["replica_predicted_s"]) for r in steps)
    assert summary["steps"] == 6
    assert list(out.glob("tb/events.out.tfevents.*"))
    assert (out / "report.png").stat().st_size > 10_000
    assert json.loads((out / "pool.json").read_text())["schema"] == "hydraulis.pool/1"
    assert 'pool = "1x(tp2,pp1)' in (out / "config.toml").read_text()
    assert "loss" in result.stdout and "tok/s" in result.stdout


def test_losses_do_not_depend_on_the_deployment(hetero_run, tmp_path, corpus, cli):
    result, hetero_out = hetero_run
    assert result.returncode == 0, result.stderr
    config = write_config(tmp_path / "one.toml", corpus, parallel='pool = "1x(tp1,pp1)"\nprofile = "tiny@cpu"')
    single = cli("train", "--config", str(config), "--nproc", "1", "--out", str(tmp_path / "one"))
    assert single.returncode == 0, single.stderr
    np.testing.assert_allclose(losses(hetero_out), losses(tmp_path / "one"), rtol=1e-5)
    assert losses(hetero_out)[-1] < losses(hetero_out)[0]


BAD = {
    "missing config": (None, "no such config file"),
    "malformed toml": ("[model\npreset = 1", "not valid TOML"),
    "unknown key": ({"train": "steps = 6\nstepz = 3"}, "unknown key 'train.stepz'"),
    "wrong type": ({"data": 'tokens_per_batch = "many"'}, "data.tokens_per_batch"),
    "unknown corpus": ({"data": 'corpus = "no-such-corpus"\ntokenizer = "bytes"'}, "no-such-corpus"),
    "pool for another world size": ({"parallel": 'pool = "2x(tp1,pp1)"'}, "larger than the pool's 2 GPUs"),
    "nproc larger than the pool": ({"parallel": 'pool = "1x(tp1,pp1)"', "_nproc": "2"}, "larger than the pool"),
    "nproc smaller than the pool": ({"_nproc": "2"}, "use 4 GPUs but the job has 2 ranks"),
    "model fits no config": (
        {"data": "tokens_per_batch = 2000000\nmax_len = 1500000\ntokenizer = \"bytes\""},
        "fits no config of the pool at max_len 1500000",
    ),
    "heads not divisible by tp": (
        {
            "model": "layers = 4\nhidden = 96\nffn = 128\nheads = 3\nkv_heads = 3\nvocab = 512",
            "parallel": 'pool = "1x(tp2,pp1) + 2x(tp1,pp1)"\nprofile = "@cpu"',
        },
        "tp=2",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, tmp_path, corpus, cli):
    change, expected = BAD[case]
    out = tmp_path / "out"
    nproc = "4"
    if change is None:
        config = tmp_path / "missing.toml"
    elif isinstance(change, str):
        config = tmp_path / "bad.toml"
        config.write_text(change)
    else:
        change = dict(change)
        nproc = change.pop("_nproc", nproc)
        if "data" in change and "corpus" not in change["data"]:
            change["data"] = f'corpus = "{corpus}"\n' + change["data"]
        config = write_config(tmp_path / "bad.toml", corpus, **change)
    result = cli("train", "--config", str(config), "--nproc", nproc, "--out", str(out))
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert not out.exists()


def test_out_holding_another_run_is_refused(hetero_run, tmp_path, corpus, cli):
    _, out = hetero_run
    config = write_config(tmp_path / "other.toml", corpus, optim="lr = 1e-3")
    result = cli("train", "--config", str(config), "--nproc", "4", "--out", str(out))
    assert result.returncode == 2
    assert "already holds a different run" in result.stderr
    same = write_config(tmp_path / "same.toml", corpus)
    again = cli("train", "--config", str(same), "--nproc", "4", "--out", str(out))
    assert again.returncode == 2 and "--resume" in again.stderr
