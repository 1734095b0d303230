"""`hydraulis train` through the real command: outputs, deployment-independent losses, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from train_helpers import BASE, losses, run_summary, step_rows, tensorboard_of, write_config  # noqa: E402

pytestmark = pytest.mark.dist

# A fifth of the documents held out, evaluated after steps 3 and 6 (all of them: the budget holds them).
EVAL = "holdout = 0.2\nevery = 3\ntokens = 1000000"


@pytest.fixture(scope="module")
def hetero_run(tmp_path_factory, corpus, session_cli):
    tmp = tmp_path_factory.mktemp("hetero")
    config = write_config(tmp / "run.toml", corpus, eval=EVAL)
    result = session_cli("train", "--config", str(config), "--nproc", "4", "--out", str(tmp / "out"), timeout=300)
    return result, tmp / "out"


def test_train_writes_the_run_directory(hetero_run):
    result, out = hetero_run
    assert result.returncode == 0, result.stderr
    steps, summary = step_rows(out), run_summary(out)
    assert [r["step"] for r in steps] == list(range(6))
    for key in ("loss", "tokens", "deployment", "iteration_s", "predicted_s", "planning_s", "lr", "grad_norm",
                "replica_s"):
        assert all(key in r for r in steps), key
    assert all(len(r["replica_s"]) == len(r["replica_predicted_s"]) for r in steps)
    assert summary["steps"] == 6
    scalars, texts = tensorboard_of(out)  # the deployment by name, as text; no budget set, none drawn
    assert texts == {r["step"]: r["deployment"] for r in steps} and "memory/budget_mib" not in scalars
    assert scalars["deployment/switches"] == dict.fromkeys(range(6), 0.0)
    assert (out / "report.png").stat().st_size > 10_000
    assert json.loads((out / "pool.json").read_text())["schema"] == "hydraulis.pool/1"
    resolved = (out / "config.toml").read_text()
    assert 'pool = "1x(tp2,pp1)' in resolved
    assert "# memory_per_rank: unset, the device's own memory" in resolved and "# gpus_per_node: unset" in resolved
    assert "loss" in result.stdout and "tok/s" in result.stdout
    # step 0's measured time holds the process's one-time setup, which its prediction does not: its line says so
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.startswith("step    0") for line in lines if "first step here: one-time setup" in line] == [True]
    # The pool never switched: the summary and the last lines say what the others were predicted to cost.
    kept = summary["never_switched"]
    assert set(summary["deployment_share"]) == {kept["deployment"]} and kept["batches"] == 6
    assert kept["memory_budget_bytes"] is None and kept["max_len"] == 256 and len(kept["others"]) == 2
    # the planner took the least predicted (a tie stays with the one it chose: the shared cores can price two alike)
    assert all(o["batches_not_held"] == 0 and o["predicted_vs_chosen"] >= 1 for o in kept["others"]), kept
    assert json.loads((out / "summary.json").read_text())["never_switched"] == kept
    said = " ".join(result.stdout.split())
    assert f"never switched: {kept['deployment']} was predicted fastest for all 6 batches" in said
    assert "every deployment held every batch of max_len 256 without a memory budget" in said
    for o in kept["others"]:
        assert f"{o['deployment']} {o['predicted_vs_chosen']:.2f}x" in said
    # An analytic profile says so at the start, with how to measure one; a warm-up within the steps says nothing.
    assert 'profile = "tiny@cpu" is the analytic model' in result.stdout and "warmup" not in result.stdout


def test_losses_do_not_depend_on_the_deployment(hetero_run, tmp_path, corpus, cli):
    result, hetero_out = hetero_run
    assert result.returncode == 0, result.stderr
    config = write_config(
        tmp_path / "one.toml", corpus, parallel='pool = "1x(tp1,pp1)"\nprofile = "tiny@cpu"', eval=EVAL
    )
    single = cli("train", "--config", str(config), "--nproc", "1", "--out", str(tmp_path / "one"))
    assert single.returncode == 0, single.stderr
    np.testing.assert_allclose(losses(hetero_out), losses(tmp_path / "one"), rtol=1e-5)
    assert losses(hetero_out)[-1] < losses(hetero_out)[0]
    np.testing.assert_allclose(eval_losses(hetero_out), eval_losses(tmp_path / "one"), rtol=1e-5)


def test_a_pipelined_pool_evaluates_forward_only_with_the_same_loss(hetero_run, tmp_path, corpus, cli):
    """Every replica a 2-stage pipeline, planned zero-bubble: the held-out batches go through the stages forward
    only, and the eval loss after 3 steps is the heterogeneous run's (itself a single process's); the steps whose
    plans defer weight gradients into the pipeline's gaps train with its losses too."""
    result, hetero_out = hetero_run
    assert result.returncode == 0, result.stderr
    parallel = 'pool = "2x(tp1,pp2)"\nprofile = "tiny@cpu"\nzero_bubble = true'
    config = write_config(tmp_path / "pp.toml", corpus, parallel=parallel, eval=EVAL)
    pp = cli("train", "--config", str(config), "--nproc", "4", "--out", str(tmp_path / "pp"), "--stop-at", "3")
    assert pp.returncode == 0, pp.stderr
    np.testing.assert_allclose(eval_losses(tmp_path / "pp"), eval_losses(hetero_out)[:1], rtol=1e-5)
    rows = [r for r in step_rows(tmp_path / "pp") if "loss" in r]
    assert any(r["deferred_replicas"] for r in rows), [r.get("deferred_replicas") for r in rows]
    np.testing.assert_allclose([r["loss"] for r in rows], losses(hetero_out)[:len(rows)], rtol=1e-5)


def eval_losses(out) -> list[float]:
    return [r["eval_loss"] for r in step_rows(out) if "eval_loss" in r]


def test_the_eval_loss_is_transformers_loss_on_the_held_out_documents(hetero_run, corpus, tmp_path, cli):
    """The oracle: the exported final weights in LlamaForCausalLM, over every held-out piece, mean per target."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    from hydraulis.data.indexed import open_corpus
    from hydraulis.data.sampler import held_out

    result, out = hetero_run
    assert result.returncode == 0, result.stderr
    evaluated = [r for r in step_rows(out) if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [2, 5] and "eval after 6 steps: loss" in result.stdout
    summary = run_summary(out)["eval"]
    assert (summary["after_step"], summary["loss"], summary["evaluations"]) == (6, evaluated[-1]["eval_loss"], 2)
    exported = cli("export", "--checkpoint", str(out / "checkpoints" / "step-000006"), "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    docs = open_corpus(corpus)
    train, held = held_out(len(docs), 0.2, 3)  # [data] seed = 3
    assert len(held) and len(train) and not set(train) & set(held)
    total, targets = 0.0, 0
    with torch.no_grad():
        for d in held:
            tokens = torch.from_numpy(np.asarray(docs[int(d)], dtype=np.int64))
            for piece in tokens.split(256):  # [data] max_len = 256, overlong = "split"
                if len(piece) > 1:
                    logits = model(piece[None]).logits[0, :-1].double()
                    total += F.cross_entropy(logits, piece[1:], reduction="sum").item()
                    targets += len(piece) - 1
    assert summary["targets"] == targets
    assert summary["loss"] == pytest.approx(total / targets, rel=1e-6)


def test_a_context_parallel_pool_trains_with_the_same_losses(hetero_run, tmp_path, corpus, cli):
    """Every deployment of this pool has CP replicas: the documents are split over CP ranks, yet the
    losses are those of the heterogeneous TP x PP run (itself equal to one process)."""
    result, hetero_out = hetero_run
    assert result.returncode == 0, result.stderr
    parallel = 'pool = "1x(tp1,pp1,cp4); 1x(tp1,pp1,cp2) + 2x(tp1,pp1)"\nprofile = "tiny@cpu+cp"'
    config = write_config(tmp_path / "cp.toml", corpus, parallel=parallel, eval=EVAL)
    cp = cli("train", "--config", str(config), "--nproc", "4", "--out", str(tmp_path / "cp"))
    assert cp.returncode == 0, cp.stderr
    assert all("cp" in r["deployment"] for r in step_rows(tmp_path / "cp"))
    np.testing.assert_allclose(losses(tmp_path / "cp"), losses(hetero_out), rtol=1e-5)
    np.testing.assert_allclose(eval_losses(tmp_path / "cp"), eval_losses(hetero_out), rtol=1e-5)  # forward-only CP


AUTO = 'pool = "1x(tp2,pp1) + 2x(tp1,pp1); 4x(tp1,pp1)"\nprofile = "auto"'


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory, corpus, session_cli):
    tmp = tmp_path_factory.mktemp("auto")
    config = write_config(tmp / "auto.toml", corpus, parallel=AUTO, train="steps = 3\nlog_every = 1")
    with pytest.MonkeyPatch.context() as mp:  # module-scoped: the autouse private cache is not set up yet
        mp.setenv("HYDRAULIS_CACHE", str(tmp / "cache"))
        result = session_cli("train", "--config", str(config), "--nproc", "4", "--out", str(tmp / "out"), timeout=300)
    return result, config, tmp / "out"


def test_profile_auto_measures_the_pool_configs_here_and_trains_on_them(auto_run):
    result, _, out = auto_run
    assert result.returncode == 0, result.stderr
    assert "profiling tiny (tp1pp1, tp2pp1) on 4 cpu rank(s)" in result.stdout
    assert "held-out median error per config" in result.stdout
    data = json.loads((out / "profile.json").read_text())
    assert data["schema"] == "hydraulis.profile/1"
    assert {(r["tp"], r["pp"]) for r in data["time_ms"]} == {(1, 1), (2, 1)}
    assert data["measurements"]["world_size"] == 4 and data["device"]["kind"] == "cpu"
    assert max(max(p["lengths"]) for p in data["measurements"]["points"]) == 256  # the sweep reaches max_len
    assert json.loads((out / "pool.json").read_text())["profile"] == data["name"]
    assert all(r["predicted_s"] > 0 for r in step_rows(out))
    assert run_summary(out)["iteration_error_median"] >= 0


def test_profile_auto_is_reused_when_it_matches_and_measured_again_otherwise(auto_run, tmp_path, cli, monkeypatch):
    result, config, out = auto_run
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    shutil.copytree(out, run)
    cached = (run / "profile.json").read_bytes()
    args = ("--nproc", "4", "--out", str(run), "--resume", "--steps", "4", "--change-schedule")
    resumed = cli("train", "--config", str(config), *args)
    assert resumed.returncode == 0, resumed.stderr
    assert "profile.json (this run directory's), measured" in resumed.stdout
    assert "profiling tiny" not in resumed.stdout
    assert (run / "profile.json").read_bytes() == cached
    # A directory holding only a profile that lacks a config of the pool: measured again, then trained.
    again = tmp_path / "again"
    again.mkdir()
    stale = json.loads(cached)
    stale["time_ms"] = [r for r in stale["time_ms"] if r["tp"] == 1]
    (again / "profile.json").write_text(json.dumps(stale))
    monkeypatch.setenv("HYDRAULIS_CACHE", str(tmp_path / "empty-cache"))  # the shared cache would serve it
    rerun = cli("train", "--config", str(config), "--nproc", "4", "--out", str(again), "--steps", "1")
    assert rerun.returncode == 0, rerun.stderr
    assert "profiling again" in rerun.stdout and "lacks tp2pp1" in rerun.stdout
    assert "warning: [optim] warmup = 2 is longer than the run's 1 steps" in rerun.stdout  # one line, at the start
    assert "is the analytic model" not in rerun.stdout
    assert {(r["tp"], r["pp"]) for r in json.loads((again / "profile.json").read_text())["time_ms"]} == {(1, 1), (2, 1)}


_PARALLEL = BASE["parallel"]
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
    "auto profile of a config that does not divide the world": (
        {"parallel": 'pool = "1x(tp2,pp1) + 1x(tp1,pp1)"\nprofile = "auto"', "_nproc": "3"},
        'parallel.profile = "auto": tp2pp1 uses 2 processes, which does not divide',
    ),
    "heads not divisible by tp": (
        {
            "model": "layers = 4\nhidden = 96\nffn = 128\nheads = 3\nkv_heads = 3\nvocab = 512",
            "parallel": 'pool = "1x(tp2,pp1) + 2x(tp1,pp1)"\nprofile = "@cpu"',
        },
        "tp=2",
    ),
    "zero exchange bucket": ({"parallel": f"{_PARALLEL}\nexchange_bucket_mb = 0"}, "parallel.exchange_bucket_mb"),
    "negative exchange bucket": ({"parallel": f"{_PARALLEL}\nexchange_bucket_mb = -4"}, "parallel.exchange_bucket_mb"),
    "exchange bucket beyond the device": (
        {"parallel": f"{_PARALLEL}\nexchange_bucket_mb = 1e9"},
        "parallel.exchange_bucket_mb 1e+09 is too large for the device's",
    ),
    "interleaving beyond the layers": (
        {"parallel": 'pool = "2x(tp1,pp2,vp4)"'}, "tp1pp2vp4: tiny has 4 layers, not divisible into pp x vp = 8"
    ),
    "zero timeout": ({"train": "steps = 6\ntimeout_s = 0"}, "train.timeout_s"),
    "negative timeout": ({"train": "steps = 6\ntimeout_s = -5"}, "train.timeout_s"),
    "timeout of a year": ({"train": "steps = 6\ntimeout_s = 31536000"}, "train.timeout_s"),
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
    same = write_config(tmp_path / "same.toml", corpus, eval=EVAL)
    again = cli("train", "--config", str(same), "--nproc", "4", "--out", str(out))
    assert again.returncode == 2 and "--resume" in again.stderr


def test_the_readme_front_page_is_short_and_its_quick_start_trains(tmp_path, cli):
    """The README's front page (up to its Reference section) reads in minutes, and its quick start's config
    trains as the README runs it: from the project's directory, on 2 processes (here 2 steps), with a pool
    to switch between."""
    root = Path(__file__).resolve().parents[2]
    front = (root / "README.md").read_text().split("\n## Reference\n")[0]
    assert len(front.splitlines()) <= 120
    assert "examples/quickstart.toml --nproc 2" in front
    result = cli("train", "--config", "examples/quickstart.toml", "--nproc", "2", "--steps", "2",
                 "--out", str(tmp_path / "quickstart"), cwd=root)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [r["step"] for r in step_rows(tmp_path / "quickstart")] == [0, 1]
    assert run_summary(tmp_path / "quickstart")["eval"]["after_step"] == 2
    # Its pool switches on 2 processes: the memory budget leaves the longer sections to two-rank replicas.
    pool = json.loads((tmp_path / "quickstart" / "pool.json").read_text())["deployments"]
    assert len(pool) >= 2 and any(r["tp"] * r["pp"] == 2 for d in pool for r in d["replicas"]), pool
