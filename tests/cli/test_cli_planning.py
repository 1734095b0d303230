"""The planning commands' words: `hydraulis plan` and `simulate` show a step's consecutive phases on one deployment
merged and say why, as `hydraulis train`'s step lines do (planner/schedule.py `phases_text`, one implementation);
`propose`'s refusals name only ways it and the commands beside it take."""

from __future__ import annotations

import json
import re

import numpy as np
from cli_helpers import one_line_error

from hydraulis.cost import load_cost_model
from hydraulis.planner.schedule import phase_runs

POOL = "1x(tp16,pp1); 2x(tp8,pp1); 1x(tp8,pp2)"


def test_plan_and_simulate_merge_repeated_phases_and_name_the_memory(cli, tmp_path):
    """The batch of tests/test_train_summary.py: its 14,810 and 14,485 tokens fit 2x(tp8,pp1) only as its
    replicas' only micro-batches, so the planner runs that deployment in two phases in a row; both tables say
    `2 phases of 2x(tp8,pp1)` once with that memory reason, counted here from the plan file and the caps."""
    rng = np.random.default_rng(6)
    batch = np.concatenate([[int(rng.integers(12000, 24576))] * int(rng.integers(1, 5)),
                            np.minimum(rng.lognormal(7.8, 1.0, 40).astype(np.int64) + 64, 20000)])
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"schema": "hydraulis.workload/1", "name": "w", "batches": [batch.tolist()]}))
    out = tmp_path / "plan.json"
    res = cli("plan", "-p", "llama-32b@a800-80g", "-n", "16", "-w", str(workload), "--pool", POOL, "-o", str(out))
    assert res.returncode == 0, res.stderr
    (iteration,) = json.loads(out.read_text())["iterations"]
    # the pool's deployments are homogeneous: each phase's name from its replicas' count and first config
    names = [f"{len(rows)}x(tp{rows[0]['tp']},pp{rows[0]['pp']})" for rows in (p["deployment"] for p in
                                                                         iteration["phases"])]
    runs = phase_runs(names)
    repeated = [(name, n) for name, n in runs if n > 1]
    assert repeated == [("2x(tp8,pp1)", 2)], names  # the plan file keeps the phases apart
    cost = load_cost_model("llama-32b@a800-80g")
    alone = 0  # replicas' only micro-batches over their config's cap beside another, in the repeated phases
    for phase, name in zip(iteration["phases"], names, strict=True):
        for replica, row in zip(phase["replicas"], phase["deployment"], strict=True):
            cap = next(cost.cap(g, 16) for g in cost.configs if (g.tp, g.pp) == (row["tp"], row["pp"]))
            tokens = [sum(iteration["lengths"][phase["indices"][i]] for i in mb) for mb in replica["micro_batches"]]
            alone += name == "2x(tp8,pp1)" and len(tokens) == 1 and tokens[0] > cap
    assert alone == 2
    said = (f"2 phases of 2x(tp8,pp1), then {names[-1]} (memory: {alone} micro-batch(es) fit only as their "
            "replica's only one)")
    assert said in res.stdout and " | " not in res.stdout, res.stdout
    sim = cli("simulate", "--plan", str(out))
    assert sim.returncode == 0 and said in sim.stdout, sim.stdout + sim.stderr
    sim_json = cli("simulate", "--plan", str(out), "--json")  # the JSON keeps each phase
    assert json.loads(sim_json.stdout)["iterations"][0]["deployment"] == " | ".join(names)


def test_propose_refuses_an_overlong_workload_naming_only_flags_that_exist(cli, tmp_path):
    """A sequence longer than every cap: `propose` has no --overlong (plan has), so its line names how the
    workload is cut where it is made (`hydraulis workload --max-len`), and every flag it names exists there."""
    workload = tmp_path / "huge.json"
    workload.write_text(json.dumps({"schema": "hydraulis.workload/1", "name": "huge", "batches": [[400000, 3000]]}))
    res = cli("propose", "-n", "16", "-w", str(workload), "-o", str(tmp_path / "pool.json"))
    line = one_line_error(res, "longer than the largest cap")
    assert res.stderr == line + "\n", res.stderr  # not even a blank line: progress leaves nothing in a log
    assert not (tmp_path / "pool.json").exists() and "--overlong" not in line, line
    assert "hydraulis workload --max-len" in line and "--max-len" in cli("workload", "--help").stdout
    profile = re.search(r"--profile (\S+)\)", line).group(1)
    assert load_cost_model(profile).name.endswith("+cp"), profile  # the CP profile it names loads
