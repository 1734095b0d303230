"""`hydraulis plan` through the real command, good and bad input."""

from __future__ import annotations

import json

import pytest
from cli_helpers import one_line_error

from hydraulis.cost import load_cost_model
from hydraulis.parallel import ParallelConfig
from hydraulis.planner.plan import load_plan
from hydraulis.planner.sim import simulate

COST = load_cost_model("llama-7b@a800-80g")  # the command's default profile: the caps it names come from it
TP2_CAP = COST.lone_cap(ParallelConfig(2, 1), 16)  # the longest sequence a tp2 replica holds, as its only micro-batch


def write(path, batches):
    path.write_text(json.dumps({"schema": "hydraulis.workload/1", "name": path.stem, "batches": batches}))
    return path



def test_plan_writes_a_valid_plan(cli, tmp_path):
    w = write(tmp_path / "w.json", [[4000, 300, 120, 9000, 700] * 20, [16000, 200, 50] * 10])
    out = tmp_path / "plan.json"
    res = cli("plan", "--profile", "llama-7b@a800-80g", "--gpus", "16", "--workload", str(w), "--out", str(out))
    assert res.returncode == 0, res.stderr
    plan = load_plan(out)
    assert plan.num_gpus == 16 and len(plan.iterations) == 2
    assert [it.step for it in plan.iterations] == [0, 1]
    sim = cli("simulate", "--plan", str(out), "--json")
    assert sim.returncode == 0, sim.stderr
    for it, row in zip(plan.iterations, json.loads(sim.stdout)["iterations"], strict=True):
        assert abs(row["iteration_time_s"] - it.iteration_time_s) < 1e-9
        # Per-GPU idle time: each GPU's time without work in compute, the bubble fraction's parts.
        idle = [sum(float(r.gpu_idle_s[g]) for r in (simulate(p, COST) for p in it.phases)) for g in range(16)]
        assert row["gpu_idle_s"] == pytest.approx(idle) and min(idle) >= 0
        assert row["bubble_fraction"] == pytest.approx(sum(idle) / (16 * row["compute_time_s"]))


def test_memory_policies_let_a_plain_replica_hold_a_long_sequence(cli, tmp_path):
    """tiny in fp32 at 28 MiB: tp1's plain cap is 1,152 tokens; with --memory-policies the 1,800-token
    sequence runs on a tp1 replica under selective recompute, which `hydraulis simulate` times alike."""
    w = write(tmp_path / "w.json", [[1800, 900, 800, 700, 600, 500, 400, 300]])
    args = ("plan", "-p", "tiny@cpu-measured", "-n", "4", "--workload", str(w), "--pool", "4x(tp1,pp1)",
            "--memory-per-rank", "28MiB", "--dtype", "fp32")
    one_line_error(cli(*args, "--out", str(tmp_path / "off.json")), "1800")
    out = tmp_path / "on.json"
    res = cli(*args, "--memory-policies", "--out", str(out))
    assert res.returncode == 0, res.stderr
    plan = load_plan(out).iterations[0].phases[0]
    assert "selective" in json.dumps(json.loads(out.read_text())["iterations"][0]["replicas"])
    sim = cli("simulate", "--plan", str(out), "--json")
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["iterations"][0]["iteration_time_s"] == pytest.approx(plan.predicted_time_s)
    one_line_error(cli(*args, "--memory-policies", "--policy", "megatron", "--out", str(tmp_path / "m.json")),
                   "--memory-policies")


def test_plan_with_inline_pool(cli, tmp_path):
    w = write(tmp_path / "w.json", [[4000, 300, 120, 9000, 700] * 8])
    out = tmp_path / "plan.json"
    pool = "8x(tp2,pp1); 1x(tp8,pp1) + 4x(tp2,pp1)"
    res = cli("plan", "--gpus", "16", "--workload", str(w), "--pool", pool, "--out", str(out))
    assert res.returncode == 0, res.stderr
    for phase in load_plan(out).iterations[0].phases:
        assert str(phase.deployment) in {"8x(tp2,pp1)", "1x(tp8,pp1) + 4x(tp2,pp1)"}


@pytest.mark.parametrize(("pool", "needle"), [
    ("4x(tp4,pp1", "item '4x(tp4,pp1' (unbalanced parentheses)"),  # truncated, named once
    ("8x(tp2,pp1)); 4x(tp4,pp1)", "(unbalanced parentheses)"),
    ("8x(tp2,pp1) + 0x(tp1,pp1)", "replica count must be 1 to"),
    ("8x(tp2,pp1); 4x(tp4,pp1) banana", "'4x(tp4,pp1) banana'"),  # trailing garbage
])  # fmt: skip
def test_a_pool_that_does_not_parse_whole_is_one_line(cli, tmp_path, pool, needle):
    w = write(tmp_path / "w.json", [[4000, 300, 120, 9000, 700] * 8])
    out = tmp_path / "plan.json"
    res = cli("plan", "--gpus", "16", "--workload", str(w), "--pool", pool, "--out", str(out))
    one_line_error(res, "--pool: cannot parse deployment item" if "count" not in needle else "--pool", needle)
    assert not out.exists() and res.stdout == ""


def test_overlong_error_names_length_and_cap(cli, tmp_path):
    w = write(tmp_path / "w.json", [[100, 200, 300000]])
    out = tmp_path / "plan.json"
    res = cli("plan", "--gpus", "16", "--workload", str(w), "--out", str(out))
    # tp2pp8 holds a lone micro-batch once per stage, not eight times (1F1B's in-flight count)
    one_line_error(res, "300000 tokens", f"largest cap {COST.lone_cap(ParallelConfig(2, 8), 16)}", "tp2pp8")
    assert not out.exists()
    res = cli("plan", "--gpus", "16", "--workload", str(w), "--pool", "8x(tp2,pp1)", "--out", str(out))
    one_line_error(res, "300000 tokens", f"largest cap {TP2_CAP}", "tp2pp1")
    assert not out.exists()


def test_overlong_truncate_and_drop_say_how_many(cli, tmp_path):
    w = write(tmp_path / "w.json", [[100, 30000, 300, 25000], [500, 600]])
    out = tmp_path / "plan.json"
    base = ("plan", "--gpus", "16", "--workload", str(w), "--pool", "8x(tp2,pp1)", "--out", str(out))
    res = cli(*base, "--overlong", "truncate")
    assert res.returncode == 0, res.stderr
    assert "truncated 2 sequence(s)" in res.stderr
    assert 600 < TP2_CAP < 25000  # so both long ones are cut, the short ones not
    assert load_plan(out).iterations[0].lengths == (100, TP2_CAP, 300, TP2_CAP)
    res = cli(*base, "--overlong", "drop")
    assert res.returncode == 0, res.stderr
    assert "dropped 2 sequence(s)" in res.stderr
    assert load_plan(out).iterations[0].lengths == (100, 300)


def test_bad_input_is_one_line_exit_2_and_no_output(cli, tmp_path):
    out = tmp_path / "plan.json"
    cases = [
        (write(tmp_path / "empty.json", [[]]), (), ("empty",)),
        (write(tmp_path / "neg.json", [[100, -5]]), (), ("-5",)),
        (write(tmp_path / "ok.json", [[100, 200]]), ("--pool", "4x(tp2,pp1)"), ("8 GPUs", "16")),
        (write(tmp_path / "ok2.json", [[100, 200]]), ("--pool", "8x(tp3,pp1)"), ("tp3",)),
        (write(tmp_path / "ok3.json", [[100, 200]]), ("--policy", "nonsense"), ("nonsense",)),
        (write(tmp_path / "ok4.json", [[100, 200]]), ("--overlong", "shrug"), ("shrug",)),
    ]
    for workload, extra, needles in cases:
        res = cli("plan", "--gpus", "16", "--workload", str(workload), "--out", str(out), *extra)
        one_line_error(res, *needles)
        assert not out.exists()
    assert not list(tmp_path.glob(".plan.json*"))


def test_plan_writes_phases_and_simulate_reads_them(cli, tmp_path):
    """llama-32b on 16 GPUs: only tp16pp1 holds 24K, so the short documents run in a phase on tp8pp2 first."""
    w = write(tmp_path / "w.json", [[24576] * 4 + [3000, 1200, 5000, 800, 2500] * 6])
    out = tmp_path / "plan.json"
    pool = "1x(tp16,pp1); 1x(tp8,pp2)"
    res = cli("plan", "-p", "llama-32b@a800-80g", "-n", "16", "-w", str(w), "--pool", pool, "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert "1x(tp8,pp2) | 1x(tp16,pp1)" in res.stdout
    (it,) = load_plan(out).iterations
    assert [str(p.deployment) for p in it.phases] == ["1x(tp8,pp2)", "1x(tp16,pp1)"]
    sim = cli("simulate", "--plan", str(out), "--json")
    assert sim.returncode == 0, sim.stderr
    (row,) = json.loads(sim.stdout)["iterations"]
    assert row["phases"] == 2 and row["deployment"] == "1x(tp8,pp2) | 1x(tp16,pp1)"
    assert abs(row["iteration_time_s"] - it.iteration_time_s) < 1e-9


def test_an_interleaved_pool_plans_simulates_and_draws_its_vp(cli, tmp_path):
    """A pool with vp: plan, simulate and the timeline name it, and the simulation runs its chunks (faster than
    the same pool's plain 1F1B); with `--zero-bubble` the plan file defers weight gradients (`deferral`), which
    `simulate` times (faster again) and draws; `--interleave` lets the proposal weigh it."""
    w = write(tmp_path / "w.json", [[3000, 1200, 5000, 800, 2500, 4000] * 6])
    times = {}
    for pool, extra in (("2x(tp1,pp8)", ()), ("2x(tp1,pp8,vp4)", ()), ("2x(tp1,pp8,vp4)", ("--zero-bubble",))):
        out = tmp_path / f"{pool}{len(extra)}.json"
        res = cli("plan", "-n", "16", "-w", str(w), "--pool", pool, "-o", str(out), *extra)
        assert res.returncode == 0, res.stderr
        (it,) = json.loads(out.read_text())["iterations"]
        assert {row.get("vp", 1) for row in it["deployment"]} == ({4} if "vp" in pool else {1})
        assert all(len(r.get("deferral", [])) == (8 if extra else 0) for r in it["replicas"])
        sim = cli("simulate", "--plan", str(out), "--json", "--timeline", str(tmp_path / "t.png"))
        assert sim.returncode == 0, sim.stderr
        (row,) = json.loads(sim.stdout)["iterations"]
        assert row["deployment"] == pool and row["deferred_replicas"] == [[0, 1] if extra else []]
        assert row["iteration_time_s"] == pytest.approx(it["predicted_time_s"], rel=1e-9)
        times[pool + "".join(extra)] = row["iteration_time_s"]
    assert times["2x(tp1,pp8,vp4)--zero-bubble"] < times["2x(tp1,pp8,vp4)"] < times["2x(tp1,pp8)"]
    res = cli("propose", "-n", "16", "-w", str(w), "-o", str(tmp_path / "p.json"), "--interleave", "--max-pool", "2")
    assert res.returncode == 0, res.stderr
