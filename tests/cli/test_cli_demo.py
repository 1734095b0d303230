"""`hydraulis demo` and `hydraulis simulate --timeline` through the real command."""

from __future__ import annotations

import json
import re
from pathlib import Path

from hydraulis.planner.plan import load_plan
from hydraulis.planner.pool import load_pool, parse_pool
from hydraulis.specs import ClusterSpec
from hydraulis.training.config import load_config

DEMO = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.toml"


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


def test_the_demo_compares_with_every_homogeneous_deployment_a_user_would_try_and_states_its_caps(cli):
    """`make demo`'s headline is over the best homogeneous deployment of its pool that held every batch
    (runtime/metering/compare.py), so the pool holds every homogeneous deployment of its 4 ranks (tp x pp of
    1, 2, 4; cp 2 and 4), with memory policies on for them as for the planned run; the caps its comment
    states are `hydraulis caps`' at its budget, and they leave long files beyond a tp1 replica."""
    config = load_config(DEMO)
    pool = parse_pool(config.parallel.pool, ClusterSpec(4))
    wanted = {f"{4 // (tp * pp)}x(tp{tp},pp{pp})" for tp in (1, 2, 4) for pp in (1, 2, 4) if tp * pp <= 4}
    assert {str(d) for d in pool if d.is_homogeneous} == wanted | {"2x(tp1,pp1,cp2)", "1x(tp1,pp1,cp4)"}
    assert config.parallel.memory_policies and any(not d.is_homogeneous for d in pool)
    res = cli("caps", "-p", "tiny@cpu-measured+cp", "-n", "4", "--memory-per-rank", config.parallel.memory_per_rank,
              "--dtype", config.train.dtype, "--json")
    assert res.returncode == 0, res.stderr
    caps = {c["config"]: (c["cap_tokens"], c["lone_cap_tokens"]) for c in json.loads(res.stdout)["configs"]}
    stated = {m[1]: (int(m[2].replace(",", "")), int(m[3].replace(",", "")))
              for m in re.finditer(r"\b(tp\dpp\d(?:cp\d)?) ([\d,]+)/([\d,]+)", DEMO.read_text())}
    assert len(stated) == 8 and all(caps[name] == cap for name, cap in stated.items()), (stated, caps)
    assert caps["tp1pp1"][0] < config.data.max_len <= caps["tp1pp1cp2"][0]
