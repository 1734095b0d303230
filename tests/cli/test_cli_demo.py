"""`hydraulis demo` and `hydraulis simulate --timeline` through the real command."""

from __future__ import annotations

import json

from hydraulis.planner.plan import load_plan
from hydraulis.planner.pool import load_pool
from hydraulis.specs import ClusterSpec


def test_demo_runs_end_to_end(cli, tmp_path):
    out = tmp_path / "demo"
    args = ("demo", "--corpus", "bbc-news", "--gpus", "16", "--tokens-per-batch", "65536", "--max-len", "8192")
    res = cli(*args, "--batches", "2", "--out", str(out))
    assert res.returncode == 0, res.stderr
    for name in ("workload.json", "pool.json", "plan.json", "compare.png", "timeline.png"):
        assert (out / name).stat().st_size > 0, name
    plan = load_plan(out / "plan.json")
    assert len(plan.iterations) == 2
    workload = json.loads((out / "workload.json").read_text())
    assert [list(it.lengths) for it in plan.iterations] == workload["batches"]
    pool = load_pool(out / "pool.json", ClusterSpec(16))
    assert pool.deployments[0].is_homogeneous
    assert "hydraulis" in res.stdout and "megatron" in res.stdout
    # a log (not a terminal) keeps its lines whole, but a section rule stays a heading, not 64K characters
    assert "1. data" in res.stdout and max(len(line) for line in res.stdout.splitlines()) < 400


def test_demo_bad_input_is_one_line(cli, tmp_path):
    res = cli("demo", "--corpus", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o"))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_simulate_writes_a_timeline(cli, tmp_path):
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"schema": "hydraulis.workload/1", "name": "w", "batches": [[9000, 300, 4000] * 6]}))
    plan = tmp_path / "plan.json"
    assert cli("plan", "-n", "16", "-w", str(workload), "-o", str(plan)).returncode == 0
    png = tmp_path / "t.png"
    res = cli("simulate", "--plan", str(plan), "--timeline", str(png))
    assert res.returncode == 0, res.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
