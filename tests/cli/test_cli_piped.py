"""Output that is not a terminal (a pipe, a log) at COLUMNS=80: no line wrapped, none padded with spaces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
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


@pytest.mark.parametrize("profile, gpus, max_len", [
    ("llama-32b@a800-80g", 16, 24576),  # only tp16pp1 holds 24K: every batch runs in phases beside 2x(tp8,pp1)
    ("llama-7b@a800-80g", 32, 32768),  # heterogeneous deployments hold 32K too: the fallback runs no batch
])
def test_the_proposal_table_counts_each_token_once_and_fills_every_row(cli, tmp_path, profile, gpus, max_len):
    """Each deployment's share of the samples' tokens, the batches it runs and their mean iteration are what
    `hydraulis plan` makes of the same batches on the proposed pool: the shares add up to 100%, every row has
    a time, and no deployment but the fallback runs none of them (one that does is said why it stays)."""
    from hydraulis.planner.plan import load_plan

    lengths, probs = get_mixture("code").histogram(max_len)
    workload, pool, plan = tmp_path / "w.json", tmp_path / "pool.json", tmp_path / "plan.json"
    workload.write_text(json.dumps({
        "schema": "hydraulis.workload/1", "name": "code", "lengths": lengths.tolist(), "counts": probs.tolist(),
        "tokens_per_batch": 262144, "num_batches": 4, "seed": 0,
    }))  # fmt: skip
    res = cli("propose", "-p", profile, "-n", str(gpus), "-w", str(workload), "-o", str(pool), env=NARROW)
    lines = _unwrapped(res, "tokens on it: its share of the 4 sample batches' tokens")
    assert cli("plan", "-p", profile, "-n", str(gpus), "-w", str(workload), "--pool", str(pool), "-o",
               str(plan)).returncode == 0  # fmt: skip
    pooled = [d["text"] for d in json.loads(pool.read_text())["deployments"]]
    usage = [d["usage"] for d in json.loads(pool.read_text())["deployments"]]
    planned = load_plan(plan).iterations
    tokens = {d: sum(p.num_tokens for it in planned for p in it.phases if str(p.deployment) == d) for d in pooled}
    on = {d: [it.iteration_time_s for it in planned if any(str(p.deployment) == d for p in it.phases)] for d in pooled}
    assert usage == pytest.approx([tokens[d] / sum(tokens.values()) for d in pooled], abs=1e-4)
    assert sum(usage) == pytest.approx(1.0, abs=1e-3) and all(on[d] for d in pooled[1:])
    rows = _table_rows(lines)
    assert len(rows) == len(pooled)
    for row, d, u in zip(rows, pooled, usage, strict=True):
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[1].startswith(d) and cells[3] == f"{u:.0%}" and cells[4] == f"{len(on[d])} of 4", cells
        if on[d]:
            assert cells[5] == f"{np.mean(on[d]):.3f}", (cells, on[d])
        else:  # the fallback, which runs none of them: its whole batches' time, and why it stays
            assert float(cells[5]) > 0 and any(line.startswith("#0 runs none of them but stays") for line in lines)
    phased = sum(len({str(p.deployment) for p in it.phases}) > 1 for it in planned)
    assert any(line.startswith(f"{phased} of the 4 batches ran in phases") for line in lines) == (phased > 0)
    assert phased == (4 if gpus == 16 else 0) and (not on[pooled[0]]) == (gpus == 32)  # both cases are seen


@pytest.mark.parametrize("args", [(), ("plan",), ("data", "build")])
def test_help_is_unwrapped(cli, args):
    res = cli(*args, "--help", env=NARROW)
    lines = _unwrapped(res)
    assert max(len(line) for line in lines) > 80  # nothing was cut at 80 columns
    assert "╭" not in res.stdout  # no boxes in a pipe
    if args == ("plan",):
        # The help of an option on one line, whole.
        assert any(line.lstrip().startswith("-p, --profile") and line.rstrip().endswith("]") for line in lines)
