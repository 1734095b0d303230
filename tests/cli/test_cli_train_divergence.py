"""The divergence guard through the real command: a NaN loss skips the optimizer step; too many stop the run."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

from train_helpers import step_rows, write_config  # noqa: E402

from hydraulis.checkpoints.manifest import read_manifest, verify_checkpoint  # noqa: E402
from hydraulis.runtime.divergence import POISON_ENV  # noqa: E402

pytestmark = pytest.mark.dist

TWO = {"parallel": 'pool = "2x(tp1,pp1); 1x(tp2,pp1)"\nprofile = "tiny@cpu"'}
ONE = {"parallel": 'pool = "1x(tp1,pp1)"\nprofile = "tiny@cpu"'}


def test_a_nan_micro_batch_skips_that_step_on_every_rank(tmp_path, corpus, cli, monkeypatch):
    config = write_config(tmp_path / "run.toml", corpus, train="steps = 5\nlog_every = 5", **TWO)
    monkeypatch.setenv(POISON_ENV, "2")
    result = cli("train", "--config", str(config), "--nproc", "2", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    done = step_rows(tmp_path / "out")
    assert [r["step"] for r in done] == list(range(5))
    assert [r["skipped"] for r in done] == [False, False, True, False, False]
    assert math.isnan(done[2]["loss"])
    # Without the skip, the NaN gradients would have made every later loss NaN.
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in done[3:])
    assert "step 2: loss nan or gradient norm nan is not finite; skipped the optimizer step" in result.stdout
    # AdamW stepped 4 times in 5 steps (its bias correction never saw the skipped step).
    last = tmp_path / "out" / "checkpoints" / "step-000005"
    assert read_manifest(last).optimizer_step == 4


def test_max_bad_steps_stops_with_one_line_keeping_the_last_good_checkpoint(tmp_path, corpus, cli, monkeypatch):
    train = "steps = 6\ncheckpoint_every = 2\nmax_bad_steps = 1\nlog_every = 5"
    config = write_config(tmp_path / "run.toml", corpus, train=train, **ONE)
    monkeypatch.setenv(POISON_ENV, "3")
    out = tmp_path / "out"
    result = cli("train", "--config", str(config), "--nproc", "1", "--out", str(out))
    assert result.returncode == 2, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "training diverged: step 3" in lines[0] and "max_bad_steps = 1" in lines[0], lines
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]
    verify_checkpoint(out / "checkpoints" / "step-000002")
    assert [r["step"] for r in step_rows(out)] == [0, 1, 2, 3]
    monkeypatch.delenv(POISON_ENV)
    more = cli("train", "--config", str(config), "--nproc", "1", "--out", str(out), "--resume")
    assert more.returncode == 0 and "resuming at step 2" in more.stdout, more.stderr
    assert [r["step"] for r in step_rows(out)] == list(range(6)) and not any(r["skipped"] for r in step_rows(out))
