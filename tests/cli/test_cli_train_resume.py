"""Resume semantics through the real command: `[train] steps` is the schedule, `--stop-at` only stops early,
and a resume plans with the cost model the run it continues planned with (its online refit included)."""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

import pytest

pytest.importorskip("torch")

from train_helpers import make_corpus, run_summary, step_rows, write_config  # noqa: E402

pytestmark = pytest.mark.dist

STEPS, STOP = 10, 6
TP1, TP2 = "2x(tp1,pp1)", "1x(tp2,pp1)"
SMALL = {
    "data": 'tokens_per_batch = 384\nmax_len = 128\nseed = 3\ntokenizer = "bytes"',
    "parallel": f'pool = "{TP1}; {TP2}"',
    "train": f"steps = {STEPS}\nlog_every = 10",
    "eval": "holdout = 0.1\nevery = 5\ntokens = 2000",
}


def _off_profile(path: Path) -> Path:
    """The measured tiny profile with tp1pp1 100x and tp2pp1 10x too fast: the planner takes 2x(tp1,pp1) until
    the online refit (after step 5: the deployment's first step warms up, 5 are watched) corrects tp1pp1,
    and 1x(tp2,pp1), still 10x too fast, from then on; the run ends before tp2pp1 has been watched 5 steps."""
    data = json.loads((resources.files("hydraulis.cost") / "profiles" / "tiny-cpu-measured.json").read_text())
    for row in data["time_ms"]:
        k = {(1, 1): 0.01, (2, 1): 0.1}.get((row["tp"], row["pp"]))
        if k is not None:
            row["a"], row["b"], row["c"] = row["a"] * k, row["b"] * k, row["c"] * k
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, session_cli) -> tuple[Path, Path, Path]:
    """A straight 10-step run, and the same config stopped at 6, just after the refit, and resumed to 10."""
    tmp = tmp_path_factory.mktemp("resume")
    parallel = SMALL["parallel"] + f'\nprofile = "{_off_profile(tmp / "profile.json")}"'
    config = write_config(tmp / "run.toml", make_corpus(tmp / "docs"), **{**SMALL, "parallel": parallel})
    straight = session_cli("train", "--config", str(config), "--nproc", "2", "--out", str(tmp / "straight"))
    assert straight.returncode == 0, straight.stderr
    assert "cost model refit after step 5: tp1pp1 x" in straight.stdout
    stop = str(STOP)
    half = session_cli("train", "--config", str(config), "--nproc", "2", "--out", str(tmp / "split"), "--stop-at", stop)
    assert half.returncode == 0, half.stderr
    assert f"stopped at step {STOP} (--stop-at) of {STEPS}" in half.stdout
    assert sorted(p.name for p in (tmp / "split" / "checkpoints").iterdir()) == [f"step-{STOP:06d}"]
    more = session_cli("train", "--config", str(config), "--nproc", "2", "--out", str(tmp / "split"), "--resume")
    assert more.returncode == 0, more.stderr
    assert f"resuming at step {STOP}" in more.stdout
    assert "refit: its checkpoint's, after step 5 (tp1pp1)" in more.stdout  # its first lines say what it plans with
    assert "planning with the cost model refit after step 5 (tp1pp1 x" in more.stdout and "refit after" not in (
        more.stdout.split("planning with the cost model refit")[1])  # no refit of its own
    return config, tmp / "straight", tmp / "split"


def test_stop_at_then_resume_equals_straight_through_bit_for_bit(runs):
    _, straight, split = runs
    a, b = step_rows(straight), step_rows(split)
    assert [r["step"] for r in b] == list(range(STEPS))
    # The same plans: the refit after step 5 moves both to tp2 at step 6, the resumed run from its checkpoint.
    assert [r["deployment"] for r in a] == [TP1] * STOP + [TP2] * (STEPS - STOP)
    for key in ("deployment", "micro_batches", "loss", "lr", "grad_norm", "epoch", "position"):
        assert [r[key] for r in b] == [r[key] for r in a], key  # ==: the same bits
    evaluated = [(r["step"], r["eval_loss"]) for r in b if "eval_loss" in r]  # the same held-out batches each time
    assert [s for s, _ in evaluated] == [4, 9]
    assert evaluated == [(r["step"], r["eval_loss"]) for r in a if "eval_loss" in r]
    # The LR follows the 10-step schedule: cosine from 3e-3 reaches its floor 3e-4 only at the last step
    # (a 6-step schedule would have reached it at step 5).
    assert b[-1]["lr"] == pytest.approx(3e-4) and b[STOP - 1]["lr"] > 1e-3
    config = (split / "config.toml").read_text().replace(str(split), str(straight))
    assert config == (straight / "config.toml").read_text()


def test_changing_the_schedule_on_resume_needs_the_flag_and_prints_both(runs, tmp_path, cli):
    config, _, split = runs
    out = tmp_path / "out"
    shutil.copytree(split, out)
    shutil.rmtree(out / "checkpoints" / f"step-{STEPS:06d}")  # continue from step STOP
    before = (out / "metrics.jsonl").read_bytes()
    refused = cli("train", "--config", str(config), "--nproc", "2", "--out", str(out), "--resume", "--steps", "30")
    assert refused.returncode == 2, refused.stdout
    line = refused.stderr.strip()
    assert "\n" not in line and f"over {STEPS} steps to" in line and "over 30 steps" in line, line
    assert "--change-schedule" in line and (out / "metrics.jsonl").read_bytes() == before
    changed = cli(
        "train", "--config", str(config), "--nproc", "2", "--out", str(out), "--resume", "--steps", "12",
        "--change-schedule",
    )  # fmt: skip
    assert changed.returncode == 0, changed.stderr
    assert f"the LR schedule changes from cosine lr 0.003 warmup 2 min_lr_ratio 0.1 over {STEPS} steps to" in (
        changed.stdout)
    assert [r["step"] for r in step_rows(out)] == list(range(12))


@pytest.mark.parametrize(("args", "message"), [(("--stop-at", "11"), "outside the schedule's 1..10"),
                                               (("--stop-at", "0"), "outside the schedule's 1..10"),
                                               (("--change-schedule",), "needs --resume"),
                                               (("--change-config",), "needs --resume")])  # fmt: skip
def test_bad_stop_at_or_schedule_flags_are_one_line(runs, tmp_path, cli, args, message):
    config = runs[0]
    result = cli("train", "--config", str(config), "--nproc", "2", "--out", str(tmp_path / "o"), *args)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_memory_a_step_did_not_measure_is_null_in_metrics_and_left_out_of_the_summary(runs):
    _, straight, split = runs
    for run in (straight, split):
        rows = step_rows(run)
        # CPU measures a sample of the steps (runtime/metering/step_memory.py): here each deployment's first.
        assert [r["step"] for r in rows if r["memory_peak_bytes"] is not None] == [0, STOP]
        for r in rows:
            unmeasured = r["memory_peak_bytes"] is None
            assert (r["exchange_peak_bytes"] is None) == unmeasured and (r["memory_error"] is None) == unmeasured
            assert r["memory_predicted_bytes"] > 0  # predicted every step
        summary = run_summary(run)
        assert summary["memory_peak_bytes"] == max(rows[0]["memory_peak_bytes"], rows[STOP]["memory_peak_bytes"])


CHANGED = {  # each config key that decides the batches and plans, and a new value for it (section, old, new)
    "data.tokens_per_batch": ("data", "tokens_per_batch = 384", "tokens_per_batch = 512"),
    "data.max_len": ("data", "max_len = 128", "max_len = 96"),
    "data.seed": ("data", "seed = 3", "seed = 4"),
    "data.corpus": ("data", None, None),  # the run's is the default (python-stdlib); then the test's own
    "parallel.pool": ("parallel", f'pool = "{TP1}; {TP2}"', f'pool = "{TP1}"'),
}


def test_a_resume_that_changes_the_batches_or_plans_is_refused_unless_meant(runs, tmp_path, cli):
    config, _, split = runs
    out = tmp_path / "out"
    shutil.copytree(split, out)
    shutil.rmtree(out / "checkpoints" / f"step-{STEPS:06d}")  # continue from step STOP
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    text, other = config.read_text(), make_corpus(tmp_path / "other-docs")
    edits = {key: (old, new) for key, (_, old, new) in CHANGED.items() if old is not None}
    edits["data.corpus"] = ('tokenizer = "bytes"', f'tokenizer = "bytes"\ncorpus = "{other}"')
    for key, (old, new) in edits.items():
        assert old in text, key
        changed = tmp_path / f"{key}.toml"
        changed.write_text(text.replace(old, new))
        refused = cli("train", "--config", str(changed), "--nproc", "2", "--out", str(out), "--resume")
        assert refused.returncode == 2, (key, refused.stdout)
        line = refused.stderr.strip()
        assert "\n" not in line and f"would change {key} (" in line and "--change-config" in line, line
        assert line.count(" -> ") == 1, line  # that key only
        assert "built into the cache" not in refused.stdout  # refused before the new corpus is built
        assert {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    everything = text
    for old, new in edits.values():
        everything = everything.replace(old, new)
    (tmp_path / "all.toml").write_text(everything)
    meant = cli("train", "--config", str(tmp_path / "all.toml"), "--nproc", "2", "--out", str(out), "--resume",
                "--change-config", "--stop-at", str(STOP + 1))  # fmt: skip
    assert meant.returncode == 0, meant.stderr
    said = next(line for line in meant.stdout.splitlines() if line.startswith("--change-config: "))
    assert all(f"{key} (" in said for key in edits), said
    # another corpus: the sampler's position meant nothing there, so the data starts at its beginning
    assert "was saved on another corpus; the data starts at this corpus's beginning" in meant.stdout
    recorded = (out / "config.toml").read_text()
    assert "tokens_per_batch = 512" in recorded and "max_len = 96" in recorded and "seed = 4" in recorded
    assert f'corpus = "{other}"' in recorded
    rows, straight = step_rows(out), step_rows(runs[1])
    assert [r["step"] for r in rows] == list(range(STOP + 1))
    assert (rows[STOP]["epoch"], rows[STOP]["position"]) == (0, 0)
    assert (straight[STOP]["epoch"], straight[STOP]["position"]) != (0, 0)  # where the old corpus had got to
