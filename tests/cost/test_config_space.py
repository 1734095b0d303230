"""The whole TP x PP x CP space (issue 42): CP up to the data-parallel width, beside any PP."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.parallel import ParallelConfig
from hydraulis.planner.plan import load_plan
from hydraulis.planner.pool import homogeneous, usable_configs
from hydraulis.specs import ClusterSpec

PROFILES = ("llama-7b@a800-80g+cp", "llama-13b@a800-80g+cp", "llama-70b@h100-80g+cp")
COSTS = {p: load_cost_model(p) for p in PROFILES}
settled = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settled
@given(profile=st.sampled_from(PROFILES), gpus=st.sampled_from([32, 64, 128, 256]))
def test_cp_reaches_the_data_parallel_width_beside_any_pp(profile, gpus):
    cost = COSTS[profile]
    configs = set(cost.caps(gpus))
    assert ParallelConfig(8, 1, gpus // 8) in configs  # the whole job one CP group of tp8 replicas
    deep = max(g.pp for g in configs if g.cp == 1)
    assert ParallelConfig(1, deep, 2) in configs or ParallelConfig(2, deep, 2) in configs
    assert all(g.num_gpus <= gpus for g in configs)


@settled
@given(profile=st.sampled_from(PROFILES), gpus=st.sampled_from([32, 64, 128]))
def test_caps_hold_more_with_more_gpus_and_alone(profile, gpus):
    """More GPUs shard the optimizer state thinner, so no cap shrinks; a lone micro-batch is in flight once."""
    cost = COSTS[profile]
    for g, cap in cost.caps(gpus).items():
        assert cost.lone_cap(g, gpus) >= cap
        assert cost.cap(g, 2 * gpus) >= cap and cost.lone_cap(g, 2 * gpus) >= cost.lone_cap(g, gpus)
        doubled = ParallelConfig(g.tp, g.pp, 2 * g.cp)
        if 2 * g.cp <= 16 and doubled.num_gpus <= gpus:  # beyond, a rank's 2 x cp padding tokens and ring latency
            assert cost.cap(doubled, gpus) >= cap and cost.lone_cap(doubled, gpus) >= cost.lone_cap(g, gpus)


@settled
@given(profile=st.sampled_from(PROFILES), gpus=st.sampled_from([32, 64, 256]))
def test_every_usable_config_places_on_the_cluster(profile, gpus):
    cost, cluster = COSTS[profile], ClusterSpec(gpus)
    for g in usable_configs(cost, cluster):
        if gpus % g.num_gpus == 0:
            d = homogeneous(g, cluster)
            devices = sorted(dev for r in d.replicas for dev in r.devices)
            assert devices == list(range(gpus)) and all(len(r.devices) == g.num_gpus for r in d.replicas)


def test_plan_holds_a_sequence_beyond_every_plain_cap_of_the_pool(cli, tmp_path):
    """The issue's llama-70b case: 32K is beyond every plain cap of the pool (tp8cp2's 6,912 the largest), and
    tp1pp16cp2 holds it as its lone micro-batch (CP beside deep PP): planned, not refused."""
    cost, pool = COSTS["llama-70b@h100-80g+cp"], "1x(tp1,pp16,cp2) + 2x(tp8,pp1,cp2)"
    deep, wide = ParallelConfig(1, 16, 2), ParallelConfig(8, 1, 2)
    assert max(cost.cap(deep, 64), cost.cap(wide, 64)) < 32768 <= cost.lone_cap(deep, 64)
    w = tmp_path / "w.json"
    w.write_text(json.dumps({"schema": "hydraulis.workload/1", "name": "w",
                             "batches": [[32768] + [3000, 1200, 800, 5000, 400] * 12]}))
    out = tmp_path / "plan.json"
    res = cli("plan", "-p", "llama-70b@h100-80g+cp", "-n", "64", "-w", str(w), "--pool", pool, "-o", str(out))
    assert res.returncode == 0, res.stderr
    plan = load_plan(out).iterations[0].phases[0]
    (r,) = [r for r, rep in enumerate(plan.deployment.replicas) if rep.config == deep]
    assert [m.tolist() for m in plan.micro_batch_lengths(r)] == [[32768]]


def test_caps_lists_the_issue_config_and_its_lone_cap(cli):
    res = cli("caps", "-p", "llama-13b@a800-80g+cp", "-n", "64", "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["config"]: r for r in json.loads(res.stdout)["configs"]}
    assert rows["tp4pp2cp8"]["lone_cap_tokens"] >= 262144 > max(r["cap_tokens"] for r in rows.values())
    assert "tp1pp1cp64" in rows and "tp2pp8cp4" in rows and np.all([r["gpus"] <= 64 for r in rows.values()])


@pytest.mark.parametrize("gpus", [64])
def test_a_crowded_batch_is_refused_truly(cli, tmp_path, gpus):
    """Beyond every plain cap, one 64-GPU replica holds a 256K sequence alone, with no room for the rest:
    the refusal says so rather than calling 262,144 tokens longer than a larger cap."""
    w = tmp_path / "w.json"
    w.write_text(json.dumps({"schema": "hydraulis.workload/1", "name": "w", "batches": [[262144] + [3000] * 20]}))
    res = cli("plan", "-p", "llama-13b@a800-80g+cp", "-n", str(gpus), "-w", str(w), "-o", str(tmp_path / "p.json"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "only as a replica's lone micro-batch" in res.stderr and "longer than the largest cap" not in res.stderr
    assert not (tmp_path / "p.json").exists()
