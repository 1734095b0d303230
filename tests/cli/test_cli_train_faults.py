"""`hydraulis train` when things go wrong: resume, preemption, a killed rank, automatic restarts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
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


def test_a_fault_soak_loses_and_repeats_no_step(tmp_path, corpus, cli):
    """Three SIGKILLs of a random rank at random steps under --max-restarts: the run ends as an uninterrupted
    one does, bit for bit (every step once, the same losses and batches, the same final weights).

    One config in the pool, so the plans cannot depend on how fast steps ran (the online refit scales a
    config's times, which moves no document between two replicas of it).
    """
    import torch

    from hydraulis.checkpoints.manifest import resolve_checkpoint
    from hydraulis.checkpoints.saver import load_master

    steps, kills = 10, 3
    parallel = 'pool = "2x(tp1,pp1)"\nprofile = "tiny@cpu"'
    config = write_config(tmp_path / "run.toml", corpus, parallel=parallel,
                          train=f"steps = {steps}\ncheckpoint_every = 1\nlog_every = 5")  # fmt: skip
    straight = cli("train", "--config", str(config), "--nproc", "2", "--out", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr
    rng = np.random.default_rng(int(os.environ.get("HYDRAULIS_SOAK_SEED", "7")))
    targets = sorted(rng.choice(np.arange(1, steps - 1), size=kills, replace=False).tolist())
    out = tmp_path / "soaked"
    proc = start("--config", str(config), "--nproc", "2", "--out", str(out), "--max-restarts", str(kills))
    killed: set[int] = set()
    for target in targets:  # after `target` steps were logged, by the ranks of the current attempt
        wait_for(lambda t=target: len(step_rows(out, running=True)) >= t and len(fresh(proc, killed)) == 2)
        victim = fresh(proc, killed)[int(rng.integers(2))]
        os.kill(victim, signal.SIGKILL)
        killed.update(fresh(proc, killed))
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert stdout.count("restarting from the last checkpoint") == kills, stdout
    a, b = step_rows(tmp_path / "straight"), step_rows(out)
    assert [r["step"] for r in b] == list(range(steps))  # none lost, none repeated
    for key in ("loss", "grad_norm", "epoch", "position", "micro_batches"):
        assert [r[key] for r in b] == [r[key] for r in a], key
    # The final weights: each run's newest complete checkpoint (what `export` of the run directory takes, a
    # path tests/cli/test_cli_train_hostile.py checks), its fp32 master read and verified in this process.
    newest = [resolve_checkpoint(tmp_path / run, sweep=False) for run in ("straight", "soaked")]
    assert [p.name for p in newest] == [f"step-{steps:06d}"] * 2, newest
    (info, a_master), (_, b_master) = (load_master(p) for p in newest)
    assert info.step == steps and a_master.numel() > 0 and torch.equal(a_master, b_master)


def fresh(proc: subprocess.Popen, killed: set[int]) -> list[int]:
    """The command's rank processes that are alive and not of an attempt already killed."""
    return [p for p in alive(rank_pids(proc.pid)) if p not in killed]
