from __future__ import annotations

import json

import pytest


def test_caps_json_matches_design(cli):
    res = cli("caps", "--profile", "llama-7b@a800-80g", "--gpus", "32", "--json")
    assert res.returncode == 0, res.stderr
    caps = {row["config"]: row["cap_tokens"] for row in json.loads(res.stdout)["configs"]}
    # tests/cost/test_cost.py derives these by hand; the brief's published caps are 11264, 21888, 46080, 85248
    assert caps["tp1pp2"] == 11520  # stage 0 binds: 2 micro-batches of 16 layers
    assert caps["tp2pp1"] == 22272
    assert caps["tp4pp1"] == 46464
    assert caps["tp8pp1"] == 85760


def test_caps_under_a_memory_budget_per_rank(cli):
    """--memory-per-rank replaces the device's memory (no context overhead, a 10% margin): tiny's fp32 state on
    4 ranks is a few MiB, and a pp2 replica's lone micro-batch holds about twice what each of several does."""
    res = cli("caps", "-p", "tiny@cpu-measured", "-n", "4", "--memory-per-rank", "40MiB", "--dtype", "fp32", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["memory_per_rank_bytes"] == 40 * 2**20 and data["usable_bytes"] == pytest.approx(36 * 2**20)
    rows = {r["config"]: r for r in data["configs"]}
    assert 0 < rows["tp1pp1"]["cap_tokens"] <= rows["tp1pp1"]["lone_cap_tokens"] < 2048
    assert rows["tp1pp2"]["lone_cap_tokens"] >= 1.4 * rows["tp1pp2"]["cap_tokens"]
    assert all(0 < r["state_bytes"] < 8 * 2**20 for r in rows.values())
    bad = cli("caps", "-p", "tiny@cpu-measured", "--memory-per-rank", "40 parsecs")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--memory-per-rank" in bad.stderr


def test_unknown_preset_is_one_line_exit_2(cli):
    res = cli("caps", "--profile", "llama-9b@nowhere")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0
    assert "llama-9b" in res.stderr


def _write_plan(tmp_path, mutate=None):
    from hydraulis.parallel import Deployment
    from hydraulis.planner.plan import PlanFile, Schedule, plan_from_assignment, save_plan
    from hydraulis.specs import ClusterSpec

    dep = Deployment.parse("1x(tp4,pp1) + 2x(tp1,pp2)", ClusterSpec(8))
    it = plan_from_assignment(3, [30000, 2000, 2000, 1000, 500], dep, [[[0]], [[1, 2]], [[3], [4]]], 1.5)
    path = tmp_path / "plan.json"
    save_plan(path, PlanFile("llama-7b@a800-80g", 8, (Schedule.single(it),)))
    if mutate:
        data = json.loads(path.read_text())
        mutate(data)
        path.write_text(json.dumps(data))
    return path


def test_simulate_reports_each_iteration(cli, tmp_path):
    res = cli("simulate", "--plan", str(_write_plan(tmp_path)), "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    (it,) = out["iterations"]
    assert it["step"] == 3
    assert it["deployment"] == "1x(tp4,pp1) + 2x(tp1,pp2)"
    assert it["iteration_time_s"] > it["compute_time_s"] > 0
    table = cli("simulate", "--plan", str(_write_plan(tmp_path)))
    assert table.returncode == 0 and "tp4" in table.stdout


def _set(path, value):
    def mutate(d):
        obj = d
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value

    return mutate


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set(["iterations", 0, "replicas", 1, "micro_batches"], [[1]]), "sequence 2 is not assigned"),
        (_set(["iterations", 0, "replicas", 1, "micro_batches"], [[1, 2, 2]]), "more than once"),
        (_set(["iterations", 0, "lengths", 1], -5), "must be at least 1"),
        (_set(["iterations", 0, "deployment", 0, "devices"], [0, 1, 2, 9]), "outside"),
        (_set(["iterations", 0, "lengths", 0], 90000), "over its cap"),
        (_set(["num_gpus"], 16), "cluster has 16"),
        (_set(["schema"], "hydraulis.plan/0"), "expected 'hydraulis.plan/1'"),
    ],
)
def test_bad_plan_is_one_line_exit_2(cli, tmp_path, mutate, message):
    res = cli("simulate", "--plan", str(_write_plan(tmp_path, mutate)))
    assert res.returncode == 2, res.stdout
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert message in res.stderr


def test_missing_plan_file(cli, tmp_path):
    res = cli("simulate", "--plan", str(tmp_path / "nope.json"))
    assert res.returncode == 2
    assert "no such file" in res.stderr
