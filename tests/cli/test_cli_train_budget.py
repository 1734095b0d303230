"""`hydraulis train` under `[parallel] memory_per_rank`: a budget the state cannot fit is refused before any
rank starts, and a budget that binds is kept, as torch's allocator measures every rank's peak, with a memory
policy per micro-batch (`memory_policies`) that the run's records show."""

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
# tiny@cpu-measured in fp32 at 24 MiB per rank, without recompute: tp1pp1 holds 896 tokens per micro-batch (1,024
# alone), tp2pp1 1,664, tp1pp2 1,024 each of several and 1,792 as a replica's lone micro-batch (`hydraulis caps`).
BUDGET = "24MiB"
PARALLEL = (
    'pool = "1x(tp1,pp2) + 1x(tp2,pp1); 1x(tp1,pp2) + 2x(tp1,pp1); 4x(tp1,pp1)"\n'
    f'profile = "tiny@cpu-measured"\nmemory_per_rank = "{BUDGET}"\nmemory_policies = true'
)


@pytest.fixture(scope="module")
def long_tail(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Short documents and a few long ones (1,500 to 1,900 bytes): 1,900 no replica holds without recompute."""
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
    assert all(r["memory_peak_bytes"] <= 24 * MiB for r in measured) and not any(r["memory_over_budget"] for r in steps)
    # Not vacuous: the budget binds (the largest measured peak is most of it), and the long documents ran as a
    # pipelined replica's lone micro-batch.
    assert max(r["memory_peak_bytes"] for r in measured) > 15 * MiB
    assert any("tp1,pp2" in r["deployment"] and r["micro_batches"][0] == 1 for r in steps)
    assert summary["memory_budget_bytes"] == 24 * MiB and summary["steps_over_budget"] == 0
    assert "warning" not in result.stdout
    # torch's CPU allocator warned of the memory meter's window once per rank here ("[rankN]:[W... CPUAllocator.cpp"):
    # no third-party warning line reaches the terminal
    assert not re.search(r"\[W\d{4} |CPUAllocator|Memory block of unknown size", result.stdout + result.stderr)
    # TensorBoard: the deployment by name, switches and phases, memory (predicted, measured where measured, budget).
    scalars, texts = tensorboard_of(tmp_path / "out")
    assert texts == {r["step"]: r["deployment"] for r in steps}
    assert scalars["memory/budget_mib"] == dict.fromkeys(range(8), 24.0)
    assert scalars["memory/peak_mib"] == pytest.approx({r["step"]: r["memory_peak_bytes"] / MiB for r in measured})
    predicted = {r["step"]: r["memory_predicted_bytes"] / MiB for r in steps}
    assert scalars["memory/predicted_mib"] == pytest.approx(predicted)
    assert scalars["deployment/phases"] == {r["step"]: r["phases"] for r in steps}
    assert scalars["deployment/switches"][7] == summary["switches"] == sum(r["switched"] for r in steps)
    assert "train/deployment" not in scalars  # not a bare index
    _memory_policies_are_recorded(steps, summary, scalars, result.stdout)


def _memory_policies_are_recorded(steps: list[dict], summary: dict, scalars: dict, stdout: str) -> None:
    """Each micro-batch's memory policy, per replica in metrics.jsonl, totalled in TensorBoard, summary.json and the
    terminal. The 1,900-byte document fits no config of the pool without recompute (BUDGET's caps), and the 8 steps
    serve the whole corpus, so some micro-batch ran selective or full."""
    assert max(r["epoch"] for r in steps) >= 1  # the first epoch served: every document, the 1,900 bytes too
    labels = ("none", "selective", "full")
    lines = stdout.splitlines()  # each printed step's line, then its replicas' line
    printed = {int(ln.split()[1]): lines[i + 1] for i, ln in enumerate(lines[:-1]) if ln.startswith("step ")}
    totals = {label: 0 for label in labels}
    for r in steps:
        policies = r["memory_choices"]["policies"]
        assert set(policies) <= set(labels) and all(len(row) == len(r["micro_batches"]) for row in policies.values())
        assert [sum(col) for col in zip(*policies.values(), strict=True)] == r["micro_batches"]  # each one, once
        for label in labels:
            n = sum(policies.get(label, ()))
            assert scalars[f"memory/policy_{label}"][r["step"]] == n
            totals[label] += n
        assert scalars["memory/alone"][r["step"]] == r["memory_choices"]["alone"]
        if r["step"] in printed:  # a printed step: the word where a policy other than none ran
            mixed = f"micro-batches by memory policy: {', '.join(f'{sum(v)} {k}' for k, v in policies.items())}"
            assert printed[r["step"]].endswith(mixed) == (set(policies) != {"none"}), (printed, policies)
    assert totals["selective"] + totals["full"] >= 1, totals  # the 1,900 bytes, at least
    choices = summary["memory_choices"]
    assert choices["micro_batches"] == {k: v for k, v in totals.items() if v}
    assert choices["steps_mixed"] == sum(len(r["memory_choices"]["policies"]) > 1 for r in steps)
    assert choices["alone"] == sum(r["memory_choices"]["alone"] for r in steps)
    closing = ", ".join(f"{v:,} {k}" for k, v in choices["micro_batches"].items())
    assert f"memory: micro-batches by policy {closing} ({choices['steps_mixed']} of 8 steps mixed them)" in stdout


def test_a_budget_the_training_state_cannot_fit_is_one_line_before_any_rank(tmp_path, long_tail, cli):
    parallel = PARALLEL.replace(BUDGET, "3MiB")
    config = write_config(tmp_path / "run.toml", long_tail, parallel=parallel)
    result = cli("train", "--config", str(config), "--nproc", "4", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "parallel.memory_per_rank 3MiB" in result.stderr and "tp1pp1 needs" in result.stderr
    assert not (tmp_path / "out").exists()
