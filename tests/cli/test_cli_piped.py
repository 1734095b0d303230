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


@pytest.mark.parametrize("args", [(), ("plan",), ("data", "build")])
def test_help_is_unwrapped(cli, args):
    res = cli(*args, "--help", env=NARROW)
    lines = _unwrapped(res)
    assert max(len(line) for line in lines) > 80  # nothing was cut at 80 columns
    assert "╭" not in res.stdout  # no boxes in a pipe
    if args == ("plan",):
        # The help of an option on one line, whole.
        assert any(line.lstrip().startswith("-p, --profile") and line.rstrip().endswith("]") for line in lines)
