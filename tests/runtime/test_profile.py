"""`hydraulis profile`: a real gloo run writes a profile that caps and plan accept; bad input fails fast."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from cli_helpers import one_line_error

from hydraulis.cost import ProfiledCostModel
from hydraulis.cost.conditions import cpu_cores
from hydraulis.cost.fit import fit_robust
from hydraulis.cost.measured import CPU_MEMORY_METHOD, build_profile, summary_rows
from hydraulis.cost.policies import MemoryPolicy
from hydraulis.cost.sweep import ProfileSettings, parse_config_list, sweep
from hydraulis.parallel import ParallelConfig
from hydraulis.runtime.metering.profiler import replicas_at_once
from hydraulis.specs import get_model

THREADS = {"threads_per_rank": max(1, cpu_cores() // 2)}  # as the launcher sets them for 2 ranks
FAST = ("--totals", "64,128", "--min-doc", "32", "--repeats", "2", "--warmup", "1", "--collective-bytes", "1024,65536")



@pytest.mark.dist
def test_profile_on_gloo_writes_a_profile_that_caps_and_plan_accept(cli, tmp_path):
    out = tmp_path / "profile.json"
    # A process spinning beside the profile takes a core from its ranks: the rounds it disturbs run again.
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        res = cli(
            "profile", "--model", "tiny", "--configs", "tp1pp1,tp2pp1,tp1pp2", "--nproc", "2", *FAST,
            "--load-retries", "1", "--out", str(out), timeout=120,
        )  # fmt: skip
    finally:
        spinner.kill()
        spinner.wait()
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert {k: data["conditions"][k] for k in ("world_size", "threads_per_rank")} == {"world_size": 2, **THREADS}
    load = data["measurements"]["load"]
    assert load["measured_again"] >= 1 and load["foreign_cores_max"] > 0.1 * data["conditions"]["cores"]
    assert "disturbed round(s) measured again" in " ".join(res.stdout.split()), res.stdout
    assert "held-out" in res.stdout and "counted tensor bytes" in res.stdout
    # stderr is a pipe here, as in a cluster log: progress comes as plain lines, ending at 100%
    progress = [line for line in res.stderr.splitlines() if line.startswith("profiling tiny on 2 process(es): ")]
    assert progress and "(100%" in progress[-1], res.stderr
    cost = ProfiledCostModel.from_file(out)
    assert {c.name for c in cost.configs} == {"tp1pp1", "tp2pp1", "tp1pp2"}
    assert data["memory"]["method"] == CPU_MEMORY_METHOD
    assert set(data["fidelity"]) == {"tp1pp1", "tp2pp1", "tp1pp2"}
    for fid in data["fidelity"].values():
        assert (
            fid["holdout"]["n"] >= 1 and fid["holdout"]["worst_abs_rel_error"] >= fid["holdout"]["median_abs_rel_error"]
        )
    points = data["measurements"]["points"]
    assert len(points) == 3 * len(sweep(ProfileSettings(totals=(64, 128), min_doc=32)))
    assert all(p["time_ms"] > 0 and len(p["stage_ms"]) == ParallelConfig.parse(p["config"]).pp for p in points)
    # Each config's memory policies, timed at the longest point: factors on a and b the cost model reads.
    assert set(data["policy_time"]) == {"tp1pp1", "tp2pp1", "tp1pp2"}
    assert all(set(f) == {"selective", "full"} and min(f.values()) >= 1 for f in data["policy_time"].values())
    full = data["policy_time"]["tp1pp1"]["full"]
    assert cost.policy_scale(ParallelConfig(1, 1), MemoryPolicy.FULL) == (full, full)
    # The measured links are in the profile and in the cost model.
    assert cost.collectives is not None and cost.collectives.world_size == 2
    for key in ("all_to_all", "p2p"):
        assert data["collectives"][key]["bandwidth_Bps"] > 0
    assert cost.grad_sync_time(2) == pytest.approx(2 * cost.collectives.all_to_all.time(2 * cost.model.num_params / 2))
    # The trainer's phase after compute, measured per config on the job's world size.
    assert data["optimizer_step"]["world_size"] == 2
    assert set(data["optimizer_step"]["ms"]) == {"tp1pp1", "tp2pp1", "tp1pp2"}
    for part in ("gather_ms", "reduce_ms"):  # measured alone too: training overlaps them with compute
        assert set(data["optimizer_step"][part]) == set(data["optimizer_step"]["ms"])
        assert all(t > 0 for t in data["optimizer_step"][part].values())
    assert cost.optimizer_step is not None and all(t > 0 for t in cost.optimizer_step.seconds.values())
    caps = cli("caps", "-p", str(out), "-n", "4", "--json")
    assert caps.returncode == 0, caps.stderr
    assert {r["config"] for r in json.loads(caps.stdout)["configs"]} == {"tp1pp1", "tp2pp1", "tp1pp2"}
    work = tmp_path / "w.json"
    work.write_text(json.dumps({"schema": "hydraulis.workload/1", "name": "w", "batches": [[300, 120, 64, 900] * 4]}))
    plan = cli("plan", "-p", str(out), "-n", "4", "-w", str(work), "--out", str(tmp_path / "plan.json"))
    assert plan.returncode == 0, plan.stderr
    assert (tmp_path / "plan.json").exists()


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("--model", "tiny", "--configs", "tp1pp1,tpXpp1"), ("tpXpp1",)),
        (("--model", "tiny", "--configs", "tp1pp1,tp4pp1", "--nproc", "2"), ("tp4pp1", "4 processes", "2")),
        (("--model", "tiny", "--configs", "tp2pp1", "--nproc", "3"), ("tp2pp1", "does not divide", "3")),
        (("--model", "tiny", "--configs", "tp1pp3", "--nproc", "3"), ("tp1pp3", "layers")),
        (("--model", "small", "--configs", "tp3pp1", "--nproc", "3"), ("tp3pp1", "heads")),
        (("--model", "nonesuch", "--configs", "tp1pp1"), ("nonesuch",)),
        (("--model", "tiny", "--configs", "tp1pp1,tp1pp1"), ("tp1pp1", "twice")),
        (("--model", "tiny", "--configs", "tp1pp1", "--device", "tpu"), ("tpu",)),
        (("--model", "tiny", "--configs", "tp1pp1", "--totals", "64,x"), ("--totals",)),
        (("--model", "tiny", "--configs", "tp1pp1", "--totals", "64", "--min-doc", "64"), ("at least 4",)),
        (("--model", "tiny", "--configs", "tp1pp1", "--load-retries", "-1"), ("--load-retries", "-1")),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_file(cli, tmp_path, args, needles):
    out = tmp_path / "profile.json"
    one_line_error(cli("profile", *args, "--out", str(out), timeout=60), *needles)
    assert not out.exists()


def test_sweep_varies_sum_and_sum_of_squares_independently():
    points = sweep(ProfileSettings())
    X = np.array([[sum(s * s for s in p), sum(p), 1.0] for p in points])
    assert np.linalg.matrix_rank(X) == 3
    by_total: dict[int, set[int]] = {}
    for p in points:
        by_total.setdefault(sum(p), set()).add(sum(s * s for s in p))
    assert sum(len(v) >= 3 for v in by_total.values()) >= 3  # one long document vs many short ones, per total
    assert all(128 <= s <= 1024 for p in points for s in p)


def test_parse_configs_keeps_parenthesised_configs_whole():
    assert parse_config_list("tp1pp1, (tp2,pp1),tp1pp2") == [
        ParallelConfig(1, 1),
        ParallelConfig(2, 1),
        ParallelConfig(1, 2),
    ]


def _rank(rank: int, config: str, stage: int, times: list[list[float]], activation: list[int]) -> dict:
    return {
        "rank": rank,
        "context_bytes": 1000,
        "threads": 1,
        "collectives": None,
        "configs": {
            config: {
                "config": config,
                "stage": stage,
                "tp_rank": 0,
                "times_s": times,
                "activation_bytes": activation,
                "static_bytes": 800,
                "params": 100,
            }
        },
    }


def test_build_profile_takes_the_slowest_stage_and_the_median_repeat():
    spec = get_model("tiny")
    settings = ProfileSettings(totals=(256, 512, 1024), min_doc=128, repeats=3)
    points = sweep(settings)
    a, b, c = 1e-8, 2e-5, 3e-3
    true = [a * sum(s * s for s in p) + b * sum(p) + c for p in points]
    # Stage 1 is the slow one; one repeat of each point is disturbed (the median of repeats drops it).
    slow = [[t, 5 * t, t] for t in true]
    fast = [[0.5 * t, 0.5 * t, 0.5 * t] for t in true]
    tokens = [sum(p) for p in points]
    ranks = [
        _rank(0, "tp1pp2", 0, fast, [100 * n for n in tokens]),
        _rank(1, "tp1pp2", 1, slow, [300 * n for n in tokens]),
    ]
    device = {
        "name": "cpu",
        "kind": "cpu",
        "memory_bytes": 2**33,
        "gpus_per_node": 64,
        "backend": "gloo",
        "dtype": "fp32",
        "description": "test",
    }
    data = build_profile(spec, [ParallelConfig(1, 2)], settings, ranks, device)
    cost = ProfiledCostModel.from_dict(data)
    for p, t in zip(points, true, strict=True):
        assert cost.stage_time(ParallelConfig(1, 2), p) == pytest.approx(t, rel=1e-3)
    assert fit_robust(points, true).coefficients.a == pytest.approx(a, rel=1e-3)
    assert data["fidelity"]["tp1pp2"]["holdout"]["worst_abs_rel_error"] < 1e-3
    # Stage 0 holds two micro-batches at 100 B/token, stage 1 one at 300: 300 B/token over L * H / tp.
    assert data["memory"]["activation_bytes_per_token_hidden_layer"]["1"] == pytest.approx(300 / (4 * 64))
    assert data["memory"]["measured_state_bytes_per_param"] == 8.0
    assert "collectives" not in data


def test_replicas_at_once_fill_the_cores_and_never_fewer_than_one():
    assert replicas_at_once(ParallelConfig(1, 1), 4, None, 1) == 4  # GPUs: every replica
    assert replicas_at_once(ParallelConfig(1, 1), 4, 2, 1) == 2
    assert replicas_at_once(ParallelConfig(2, 1), 4, 2, 1) == 1
    assert replicas_at_once(ParallelConfig(4, 1), 4, 2, 1) == 1  # more ranks than cores: one replica still runs
    assert replicas_at_once(ParallelConfig(1, 1), 4, 16, 2) == 4


def test_build_profile_uses_the_replicas_that_ran_and_records_the_shared_cores():
    spec = get_model("tiny")
    settings = ProfileSettings(totals=(256, 512, 1024), min_doc=128, repeats=3)
    points = sweep(settings)
    true = [1e-8 * sum(s * s for s in p) + 2e-5 * sum(p) + 3e-3 for p in points]
    ran = _rank(0, "tp1pp1", 0, [[t, t, t] for t in true], [100 * sum(p) for p in points])
    waited = dict(_rank(1, "tp1pp1", 0, [], []), configs={})  # one core: rank 1's replica waited
    for r in (ran, waited):
        r.update(cores=1, busy_ranks={"tp1pp1": 1})
    device = {"name": "cpu", "kind": "cpu", "memory_bytes": 2**33, "gpus_per_node": 64, "backend": "gloo",
              "dtype": "fp32", "description": "test"}
    data = build_profile(spec, [ParallelConfig(1, 1)], settings, [ran, waited], device)
    assert data["shared_cores"] == {"cores": 1, "threads_per_rank": 1}
    assert data["time_ms"][0]["busy_ranks"] == 1 and data["measurements"]["world_size"] == 2
    assert "policy_time" not in data  # not timed (an older profile's ranks): the derived factors apply
    ran["configs"]["tp1pp1"].update(policy_point=2, policy_times_s={"selective": [1.5 * true[2]] * 3,
                                                                    "full": [2 * true[2] - 3e-3] * 3})
    data = build_profile(spec, [ParallelConfig(1, 1)], settings, [ran, waited], device)
    # (time - c) over (plain time - c): full doubles a and b here, selective adds 1.5 t - c over t - c.
    factors = data["policy_time"]["tp1pp1"]
    assert factors["full"] == pytest.approx(2, rel=1e-3)
    assert factors["selective"] == pytest.approx((1.5 * true[2] - 3e-3) / (true[2] - 3e-3), rel=1e-3)
    cost = ProfiledCostModel.from_dict(data)
    assert cost.policy_scale(ParallelConfig(1, 1), MemoryPolicy.FULL) == pytest.approx((2, 2), rel=1e-3)
    assert cost.shared_cores is not None and cost.shared_cores.busy_ranks == {ParallelConfig(1, 1): 1}
    for p, t in zip(points, true, strict=True):
        assert cost.stage_time(ParallelConfig(1, 1), p) == pytest.approx(t, rel=1e-3)


def test_cpu_memory_counts_saved_activations_once_and_no_parameters():
    import torch

    from hydraulis.runtime.metering.measurements import SavedTensors as _SavedTensors

    layer = torch.nn.Linear(16, 32)
    x = torch.randn(10, 16, requires_grad=True)
    saved = _SavedTensors(list(layer.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        h = layer(x)  # saves x (the weight is a parameter: not counted)
        y = (h * h).sum()  # saves h, twice as the same storage: counted once
    y.backward()
    assert saved.total == x.numel() * 4 + h.numel() * 4


@pytest.mark.dist
def test_profiler_measures_context_parallel_configs():
    """cp2 runs each CP rank's share (fewer tokens per rank) and becomes a cp row the cost model reads."""
    import cp_workers
    from dist_launcher import run_workers

    from hydraulis.runtime.metering.profiler import describe_device

    spec = get_model("tiny")
    configs = [ParallelConfig(1, 1), ParallelConfig(1, 1, 2)]
    settings = ProfileSettings(totals=(64, 128), min_doc=32, repeats=2, warmup=1, collective_bytes=(1024, 4096),
                               collective_repeats=1)
    ranks = run_workers(cp_workers.measure_configs, 2, configs, settings, deadline_s=120)
    points = sweep(settings)
    for r in ranks:
        cp = r["configs"]["tp1pp1cp2"]
        assert cp["cp_rank"] == r["rank"]
        assert all(t <= -(-sum(p) // 2) + 4 for t, p in zip(cp["tokens"], points, strict=True))
        assert r["configs"]["tp1pp1"]["tokens"] == [sum(p) for p in points]
    assert sum(r["configs"]["tp1pp1cp2"]["tokens"][-1] for r in ranks) == sum(points[-1])
    data = build_profile(spec, configs, settings, ranks, describe_device("cpu", 2, "fp32", 1))
    assert [row.get("cp", 1) for row in data["time_ms"]] == [1, 2]
    assert [r[0] for r in summary_rows(data)] == ["tp1pp1", "tp1pp1cp2"]  # the closing table names the cp row
    cost = ProfiledCostModel.from_dict(data)
    assert set(cost.configs) == set(configs)
    assert cost.cap(ParallelConfig(1, 1, 2), 2) > cost.cap(ParallelConfig(1, 1), 2)
