"""Resume semantics through the real command: `[train] steps` is the schedule, `--stop-at` only stops early."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from train_helpers import make_corpus, step_rows, write_config  # noqa: E402

pytestmark = pytest.mark.dist

STEPS = 20
SMALL = {
    "data": 'tokens_per_batch = 384\nmax_len = 128\nseed = 3\ntokenizer = "bytes"',
    "parallel": 'pool = "1x(tp1,pp1)"\nprofile = "tiny@cpu"',
    "train": f"steps = {STEPS}\nlog_every = 10",
    "eval": "holdout = 0.1\nevery = 5\ntokens = 2000",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, session_cli) -> tuple[Path, Path, Path]:
    """A straight 20-step run, and the same config stopped at 10 and resumed to 20 (one process each)."""
    tmp = tmp_path_factory.mktemp("resume")
    config = write_config(tmp / "run.toml", make_corpus(tmp / "docs"), **SMALL)
    straight = session_cli("train", "--config", str(config), "--nproc", "1", "--out", str(tmp / "straight"))
    assert straight.returncode == 0, straight.stderr
    half = session_cli("train", "--config", str(config), "--nproc", "1", "--out", str(tmp / "split"), "--stop-at", "10")
    assert half.returncode == 0, half.stderr
    assert "stopped at step 10 (--stop-at) of 20" in half.stdout
    assert sorted(p.name for p in (tmp / "split" / "checkpoints").iterdir()) == ["step-000010"]
    more = session_cli("train", "--config", str(config), "--nproc", "1", "--out", str(tmp / "split"), "--resume")
    assert more.returncode == 0, more.stderr
    assert "resuming at step 10" in more.stdout
    return config, tmp / "straight", tmp / "split"


def test_stop_at_then_resume_equals_straight_through_bit_for_bit(runs):
    _, straight, split = runs
    a, b = step_rows(straight), step_rows(split)
    assert [r["step"] for r in b] == list(range(STEPS))
    for key in ("loss", "lr", "grad_norm", "epoch", "position"):
        assert [r[key] for r in b] == [r[key] for r in a], key  # ==: the same bits
    evaluated = [(r["step"], r["eval_loss"]) for r in b if "eval_loss" in r]  # the same held-out batches each time
    assert [s for s, _ in evaluated] == [4, 9, 14, 19]
    assert evaluated == [(r["step"], r["eval_loss"]) for r in a if "eval_loss" in r]
    # The LR follows the 20-step schedule: cosine from 3e-3 reaches its floor 3e-4 only at the last step
    # (a 10-step schedule would have reached it at step 9).
    assert b[-1]["lr"] == pytest.approx(3e-4) and b[9]["lr"] > 1e-3
    config = (split / "config.toml").read_text().replace(str(split), str(straight))
    assert config == (straight / "config.toml").read_text()


def test_changing_the_schedule_on_resume_needs_the_flag_and_prints_both(runs, tmp_path, cli):
    config, _, split = runs
    out = tmp_path / "out"
    shutil.copytree(split, out)
    shutil.rmtree(out / "checkpoints" / "step-000020")  # continue from step 10
    before = (out / "metrics.jsonl").read_bytes()
    refused = cli("train", "--config", str(config), "--nproc", "1", "--out", str(out), "--resume", "--steps", "30")
    assert refused.returncode == 2, refused.stdout
    line = refused.stderr.strip()
    assert "\n" not in line and "over 20 steps to" in line and "over 30 steps" in line, line
    assert "--change-schedule" in line and (out / "metrics.jsonl").read_bytes() == before
    changed = cli(
        "train", "--config", str(config), "--nproc", "1", "--out", str(out), "--resume", "--steps", "12",
        "--change-schedule",
    )  # fmt: skip
    assert changed.returncode == 0, changed.stderr
    assert "the LR schedule changes from cosine lr 0.003 warmup 2 min_lr_ratio 0.1 over 20 steps to" in changed.stdout
    assert [r["step"] for r in step_rows(out)] == list(range(12))


@pytest.mark.parametrize(("args", "message"), [(("--stop-at", "21"), "outside the schedule's 1..20"),
                                               (("--stop-at", "0"), "outside the schedule's 1..20"),
                                               (("--change-schedule",), "needs --resume")])  # fmt: skip
def test_bad_stop_at_or_schedule_flags_are_one_line(runs, tmp_path, cli, args, message):
    config = runs[0]
    result = cli("train", "--config", str(config), "--nproc", "1", "--out", str(tmp_path / "o"), *args)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
