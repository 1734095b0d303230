"""`hydraulis train` under `[parallel] memory_per_rank`: a budget the state cannot fit is refused before any
rank starts, and a budget that binds is kept, as torch's allocator measures every rank's peak."""

from __future__ import annotations

import re
import string
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from train_helpers import run_summary, step_rows, tensorboard_of, write_config  # noqa: E402

from hydraulis.data.build.corpus import build_corpus  # noqa: E402

pytestmark = pytest.mark.dist

MiB = 2**20
# tiny@cpu-measured in fp32 at 40 MiB per rank: tp1pp1 holds 1,664 tokens per micro-batch (1,792 alone), tp2pp1
# 2,816, tp1pp2 1,792 each of several and 3,200 as a replica's lone micro-batch (`hydraulis caps`).
BUDGET = "40MiB"
PARALLEL = (
    'pool = "1x(tp1,pp2) + 1x(tp2,pp1); 1x(tp1,pp2) + 2x(tp1,pp1); 4x(tp1,pp1)"\n'
    f'profile = "tiny@cpu-measured"\nmemory_per_rank = "{BUDGET}"'
)


@pytest.fixture(scope="module")
def long_tail(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Short documents and a few long ones (1,500 to 1,900 bytes): 1,900 no tp1 replica holds under the budget."""
    rng = np.random.default_rng(1)
    letters = list(string.ascii_lowercase + " ")
    sizes = [*rng.integers(80, 700, size=40), 1500, 1700, 1900]
    docs = ["".join(rng.choice(letters, size=int(n))) for n in sizes]
    out = tmp_path_factory.mktemp("long-tail") / "docs"
    build_corpus(docs, out, "bytes", "long-tail test documents", name="docs")
    return out


def test_a_budget_that_binds_is_kept_on_every_rank(tmp_path, long_tail, cli):
    data = f'corpus = "{long_tail}"\ntokens_per_batch = 4096\nmax_len = 2048\nseed = 2\ntokenizer = "bytes"'
    config = write_config(tmp_path / "run.toml", long_tail, parallel=PARALLEL, data=data,
                          train="steps = 8\nlog_every = 4")
    result = cli("train", "--config", str(config), "--nproc", "4", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    steps, summary = step_rows(tmp_path / "out"), run_summary(tmp_path / "out")
    measured = [r for r in steps if r["memory_peak_bytes"] is not None]  # null: not measured
    # Measured: each deployment's first step and each step whose predicted peak was a rank's highest yet.
    assert len(measured) >= 3
    assert all(r["memory_peak_bytes"] <= 40 * MiB for r in measured) and not any(r["memory_over_budget"] for r in steps)
    # Not vacuous: the budget binds (the largest measured peak is most of it), and the long documents ran as a
    # pipelined replica's lone micro-batch.
    assert max(r["memory_peak_bytes"] for r in measured) > 24 * MiB
    assert any("tp1,pp2" in r["deployment"] and r["micro_batches"][0] == 1 for r in steps)
    assert summary["memory_budget_bytes"] == 40 * MiB and summary["steps_over_budget"] == 0
    assert "warning" not in result.stdout
    # torch's CPU allocator warned of the memory meter's window once per rank here ("[rankN]:[W... CPUAllocator.cpp"):
    # no third-party warning line reaches the terminal
    assert not re.search(r"\[W\d{4} |CPUAllocator|Memory block of unknown size", result.stdout + result.stderr)
    # TensorBoard: the deployment by name, switches and phases, memory (predicted, measured where measured, budget).
    scalars, texts = tensorboard_of(tmp_path / "out")
    assert texts == {r["step"]: r["deployment"] for r in steps}
    assert scalars["memory/budget_mib"] == dict.fromkeys(range(8), 40.0)
    assert scalars["memory/peak_mib"] == pytest.approx({r["step"]: r["memory_peak_bytes"] / MiB for r in measured})
    predicted = {r["step"]: r["memory_predicted_bytes"] / MiB for r in steps}
    assert scalars["memory/predicted_mib"] == pytest.approx(predicted)
    assert scalars["deployment/phases"] == {r["step"]: r["phases"] for r in steps}
    assert scalars["deployment/switches"][7] == summary["switches"] == sum(r["switched"] for r in steps)
    assert "train/deployment" not in scalars  # not a bare index


def test_a_budget_the_training_state_cannot_fit_is_one_line_before_any_rank(tmp_path, long_tail, cli):
    parallel = PARALLEL.replace(BUDGET, "3MiB")
    config = write_config(tmp_path / "run.toml", long_tail, parallel=parallel)
    result = cli("train", "--config", str(config), "--nproc", "4", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "parallel.memory_per_rank 3MiB" in result.stderr and "tp1pp1 needs" in result.stderr
    assert not (tmp_path / "out").exists()
