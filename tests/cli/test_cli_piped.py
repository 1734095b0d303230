"""Output that is not a terminal (a pipe, a log) at COLUMNS=80: no line wrapped, none padded with spaces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hydraulis.bench import SCENARIOS
from hydraulis.data.synthetic import get_mixture
from hydraulis.report import summary_lines

NARROW = {"COLUMNS": "80"}


def _unwrapped(result, *whole: str) -> list[str]:
    """The lines of a successful command: no trailing spaces, and each of `whole` on one line."""
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert not [line for line in lines if line != line.rstrip()], result.stdout
    for text in whole:
        assert any(text in line for line in lines), (text, result.stdout)
    return lines


def _table_rows(lines: list[str]) -> list[str]:
    """A rich table's body rows (between the header rule and the bottom rule)."""
    return [line for line in lines if line.startswith("│")]


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lengths, probs = get_mixture("wiki").histogram(16384)
    path = tmp_path_factory.mktemp("piped") / "a-workload-with-a-rather-long-name-for-the-title.json"
    path.write_text(json.dumps({
        "schema": "hydraulis.workload/1", "name": "wiki", "lengths": lengths.tolist(), "counts": probs.tolist(),
        "tokens_per_batch": 131072, "num_batches": 2, "seed": 0,
    }))  # fmt: skip
    return path


def test_bench_is_unwrapped_and_judges_only_the_whole_set_against_the_targets(cli, tmp_path):
    scenario = SCENARIOS[0].name
    res = cli("bench", "-s", scenario, "--policy", "hydraulis", "-o", str(tmp_path / "b"), env=NARROW)
    lines = _unwrapped(res, "hydraulis bench (simulated; same cost model and batches for every policy)")
    assert len(_table_rows(lines)) == 2  # hydraulis and megatron, one line each
    # one scenario is not the project's set: its figures, no "NOT met", and a line saying why
    assert not [line for line in lines if "target >=" in line or "met" in line.split()], lines
    assert any(line.startswith(f"the project's targets (docs/results.md) are for all {len(SCENARIOS)} scenarios")
               and "this run has 1 and 1" in line for line in lines), lines  # fmt: skip
    report = json.loads((tmp_path / "b" / "bench.json").read_text())
    efficiency = next(line for line in lines if line.startswith("hydraulis balance efficiency"))
    assert efficiency.endswith(f"worst scenario: {report['summary']['min_balance_efficiency']:.3f}"), efficiency
    # the whole set is judged: each figure with its target, met or not as the figure says
    judged = [line for line in summary_lines(report) if line.startswith("hydraulis balance efficiency")]
    assert judged[0].endswith("NOT met)") == (report["summary"]["min_balance_efficiency"] < 0.92), judged


def test_propose_and_plan_are_unwrapped(cli, tmp_path, workload):
    pool = tmp_path / "pool.json"
    res = cli("propose", "-n", "16", "-w", str(workload), "-o", str(pool), "--max-pool", "2", env=NARROW)
    lines = _unwrapped(res, f"-> {pool}", "tokens/s with the pool vs")
    assert len(_table_rows(lines)) == len(json.loads(pool.read_text())["deployments"])
    plan = tmp_path / "plan.json"
    res = cli("plan", "-n", "16", "-w", str(workload), "--pool", str(pool), "-o", str(plan), env=NARROW)
    lines = _unwrapped(res, f"-> {plan}")
    assert len(_table_rows(lines)) == 2  # one row per batch
    planned = json.loads(plan.read_text())["iterations"]
    tokens = sum(sum(it["lengths"]) for it in planned)
    assert f"total: 2 iteration(s), {tokens:,} tokens in " in lines[-1], lines  # the totals, from the plan file
    png = tmp_path / "t.png"
    res = cli("simulate", "--plan", str(plan), "--timeline", str(png), env=NARROW)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert f"total: 2 iteration(s), {tokens:,} tokens in " in lines[-2], lines
    assert lines[-1].startswith(f"wrote {png} ") and png.read_bytes()[:4] == b"\x89PNG"  # the file it announces


def test_the_proposal_table_says_what_its_shares_and_blanks_mean():
    """A phased pool's shares add up to more than 100%, a deployment may run no sample batch, and one that only
    runs phases has no whole-batch time: each is said in a line under the table."""
    from hydraulis.cli.propose import _table_notes

    rows = [{"usage": 0.75, "mean_time_s": 1.9}, {"usage": 0.5, "mean_time_s": None},
            {"usage": 0.0, "mean_time_s": 2.1}]
    notes = _table_notes(rows, 8)
    assert notes[0].startswith("batches on it: the share of the 8 sample batches") and "add up to 125%" in notes[0]
    assert notes[1].startswith("#2: no sample batch ran on it") and notes[2].startswith("phases only:")
    assert _table_notes([{"usage": 0.6, "mean_time_s": 1.0}, {"usage": 0.4, "mean_time_s": 1.1}], 8) == []


@pytest.mark.parametrize("args", [(), ("plan",), ("data", "build")])
def test_help_is_unwrapped(cli, args):
    res = cli(*args, "--help", env=NARROW)
    lines = _unwrapped(res)
    assert max(len(line) for line in lines) > 80  # nothing was cut at 80 columns
    assert "╭" not in res.stdout  # no boxes in a pipe
    if args == ("plan",):
        # The help of an option on one line, whole.
        assert any(line.lstrip().startswith("-p, --profile") and line.rstrip().endswith("]") for line in lines)
