"""A two-source mixture through the real command: each weight's share of the tokens, reported, resumed bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from train_helpers import make_corpus, make_sft_records, run_summary, step_rows, write_config  # noqa: E402

pytestmark = pytest.mark.dist

STEPS = 50
MIXTURE = {
    "data": 'weights = [0.8, 0.2]\ntokens_per_batch = 256\nmax_len = 64\nseed = 3\ntokenizer = "bytes"',
    "parallel": 'pool = "1x(tp1,pp1)"\nprofile = "tiny@cpu"',
    "train": f"steps = {STEPS}\nlog_every = 25",
    "eval": "holdout = 0.1\nevery = 25\ntokens = 1000",  # a holdout share of the mixture: its documents too
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, session_cli) -> tuple[Path, Path, str]:
    """A straight 50-step run of docs (0.8, a built corpus) and sums (0.2, SFT records in a jsonl file), and the
    same stopped at 25 and resumed (one process)."""
    tmp = tmp_path_factory.mktemp("mixture")
    docs, sums = make_corpus(tmp / "docs"), make_sft_records(tmp / "sums.jsonl")
    data = f'corpus = ["{docs}", "{sums}"]\n' + MIXTURE["data"]
    config = write_config(tmp / "run.toml", docs, **{**MIXTURE, "data": data})
    straight = session_cli("train", "--config", str(config), "--nproc", "1", "--out", str(tmp / "straight"))
    assert straight.returncode == 0, straight.stderr
    args = ("train", "--config", str(config), "--nproc", "1", "--out", str(tmp / "split"))
    half = session_cli(*args, "--stop-at", "25")
    assert half.returncode == 0, half.stderr
    more = session_cli(*args, "--resume")
    assert more.returncode == 0, more.stderr
    assert "resuming at step 25" in more.stdout
    return tmp / "straight", tmp / "split", straight.stdout


def test_each_source_gets_its_weight_of_the_tokens_and_is_reported(runs):
    straight, _, stdout = runs
    rows = step_rows(straight)
    assert len(rows) == STEPS
    for r in rows:  # every token of a step belongs to one source
        assert sum(r["source_tokens"].values()) == r["tokens"]
    targets = {n: sum(r["source_targets"][n] for r in rows) for n in ("docs", "sums")}
    tokens_of = {n: sum(r["source_tokens"][n] for r in rows) for n in ("docs", "sums")}
    assert targets["docs"] > 0.95 * tokens_of["docs"]  # plain text: every token but a piece's first
    assert 0 < targets["sums"] < 0.25 * tokens_of["sums"]  # SFT: the completions and their eos only
    tokens = sum(r["tokens"] for r in rows)
    shares = {n: sum(r["source_tokens"][n] for r in rows) / tokens for n in ("docs", "sums")}
    assert shares["docs"] == pytest.approx(0.8, abs=0.02) and shares["sums"] == pytest.approx(0.2, abs=0.02)
    summary = run_summary(straight)
    assert {n: v["token_share"] for n, v in summary["sources"].items()} == pytest.approx(shares, abs=1e-12)
    assert {n: v["weight"] for n, v in summary["sources"].items()} == pytest.approx({"docs": 0.8, "sums": 0.2})
    assert f"sources: docs {shares['docs']:.1%} of tokens (weight 80.0%)" in stdout
    assert summary["eval"]["evaluations"] == 2


def test_stop_at_then_resume_equals_the_straight_run_bit_for_bit(runs):
    straight, split, _ = runs
    a, b = step_rows(straight), step_rows(split)
    assert [r["step"] for r in b] == list(range(STEPS))
    for key in ("loss", "grad_norm", "source_tokens", "source_targets", "epoch", "position"):
        assert [r[key] for r in b] == [r[key] for r in a], key  # ==: the same bits
    assert [r.get("eval_loss") for r in b] == [r.get("eval_loss") for r in a]
    assert run_summary(split)["sources"] == run_summary(straight)["sources"]
