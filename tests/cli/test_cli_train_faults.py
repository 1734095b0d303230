"""`hydraulis train` when things go wrong: resume, preemption, a killed rank, automatic restarts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from cli_helpers import rank_pids  # noqa: E402
from train_helpers import step_rows, write_config  # noqa: E402

from hydraulis.data.indexed import open_corpus  # noqa: E402
from hydraulis.data.sampler import TokenBudgetSampler  # noqa: E402

pytestmark = pytest.mark.dist

SRC = Path(__file__).resolve().parents[2] / "src"
TWO = {"parallel": 'pool = "2x(tp1,pp1); 1x(tp2,pp1)"\nprofile = "tiny@cpu"'}


def start(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-m", "hydraulis.cli", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def wait_for(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.1)


def alive(pids: list[int]) -> list[int]:
    living = []
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            living.append(p)
    return living


def test_sigterm_saves_at_the_step_boundary_and_exits_0(tmp_path, corpus):
    config = write_config(tmp_path / "run.toml", corpus, train="steps = 400\nlog_every = 50", **TWO)
    out = tmp_path / "out"
    proc = start("--config", str(config), "--nproc", "2", "--out", str(out))
    wait_for(lambda: len(step_rows(out, running=True)) >= 2)
    ranks = rank_pids(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    done = step_rows(out, running=True)
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert [p.name for p in saved] == [f"step-{len(done):06d}"]
    assert [r["step"] for r in done] == list(range(len(done)))
    assert not alive(ranks)


def test_a_killed_rank_ends_the_job_naming_it(tmp_path, corpus):
    config = write_config(tmp_path / "run.toml", corpus, train="steps = 400\nlog_every = 50")
    out = tmp_path / "out"
    proc = start("--config", str(config), "--nproc", "4", "--out", str(out))
    wait_for(lambda: len(step_rows(out, running=True)) >= 1)
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 4
    killed_at = time.monotonic()
    os.kill(ranks[2], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=90)
    assert time.monotonic() - killed_at < 60
    assert proc.returncode == 2
    lines = stderr.strip().splitlines()
    assert re.fullmatch(r"error: rank \d died by signal SIGKILL", lines[-1]), stderr
    assert not alive(ranks)


def test_restarts_resume_without_skipping_or_repeating_a_batch(tmp_path, corpus):
    steps = 10
    config = write_config(
        tmp_path / "run.toml", corpus, train=f"steps = {steps}\ncheckpoint_every = 2\nlog_every = 5", **TWO
    )
    out = tmp_path / "out"
    proc = start("--config", str(config), "--nproc", "2", "--out", str(out), "--max-restarts", "1")
    second = out / "checkpoints" / "step-000002" / "manifest.json"
    wait_for(lambda: second.is_file() and len(step_rows(out, running=True)) >= 3)
    os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr
    assert "restarting from the last checkpoint" in stdout
    done = step_rows(out, running=True)
    assert [r["step"] for r in done] == list(range(steps))
    # The batches an uninterrupted run consumes, from the sampler itself.
    c = open_corpus(corpus)
    expected = [(b.state.epoch, b.state.position) for b in TokenBudgetSampler(c.lengths, 768, 256, 3).batches(steps)]
    assert [(r["epoch"], r["position"]) for r in done] == expected
