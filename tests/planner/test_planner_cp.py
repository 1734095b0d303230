"""Context parallelism in the planner: CP replicas hold what no TP x PP replica can, and are chosen only
where they pay or are needed; through the real command, whole documents stay whole."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_helpers import one_line_error
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.baselines import make_policy
from hydraulis.cost import load_cost_model
from hydraulis.planner.planner import Planner, apply_overlong
from hydraulis.planner.policy import PolicyContext
from hydraulis.planner.pool import parse_pool
from hydraulis.planner.proposal.propose import propose
from hydraulis.specs import ClusterSpec

COST = load_cost_model("llama-7b@a800-80g+cp")
GPUS = 32
CLUSTER = ClusterSpec(GPUS)
PLAIN = parse_pool("2x(tp8,pp1) + 8x(tp2,pp1)", CLUSTER)[0]
WITH_CP = parse_pool("1x(tp8,pp1,cp2) + 8x(tp2,pp1)", CLUSTER)[0]
PLAIN_CAP = max(COST.lone_cap(g, GPUS) for g in COST.configs if g.cp == 1 and g.num_gpus <= GPUS)


def batches(max_long: int):
    short = st.lists(st.integers(50, 8000), min_size=1, max_size=60)
    long = st.lists(st.integers(8000, max_long), min_size=0, max_size=3)
    return st.tuples(short, long).map(lambda sl: np.array(sl[0] + sl[1], dtype=np.int64))


@settings(max_examples=25, deadline=None)
@given(batches(COST.cap(WITH_CP.configs[0], GPUS)))
def test_cp_plans_hold_caps_and_place_every_sequence_once(lengths):
    plan = Planner(COST, GPUS, [WITH_CP]).plan(lengths)
    plan.validate(COST, GPUS)  # every index once, every micro-batch within its replica's (CP) cap
    placed = sorted(i for r in plan.replicas for mb in r.micro_batches for i in mb)
    assert placed == list(range(len(lengths)))
    cp_members = {i for mb in plan.replicas[0].micro_batches for i in mb}
    # Needed: what no cp = 1 replica of the deployment holds, even as its lone micro-batch, runs on the CP
    # replica, whole.
    assert {i for i, s in enumerate(lengths) if s > COST.lone_cap(WITH_CP.configs[1], GPUS)} <= cp_members
    assert plan.lengths == tuple(int(s) for s in lengths)


@settings(max_examples=20, deadline=None)
@given(batches(int(0.95 * COST.cap(PLAIN.configs[0], GPUS))))
def test_cp_is_chosen_only_where_it_pays(lengths):
    plain = Planner(COST, GPUS, [PLAIN]).plan(lengths)
    chosen = Planner(COST, GPUS, [PLAIN, WITH_CP]).plan(lengths)
    assert chosen.predicted_time_s <= plain.predicted_time_s * (1 + 1e-9)
    if any(g.cp > 1 for g in chosen.deployment.configs):
        assert chosen.predicted_time_s < plain.predicted_time_s


def test_a_sequence_beyond_every_tp_pp_cap_goes_whole_to_a_cp_replica():
    lengths = np.array([PLAIN_CAP + 20_000] + [3000] * 40)
    pool = propose(COST, CLUSTER, [lengths, lengths[::-1].copy()], max_pool=3).pool.deployments
    assert any(g.cp > 1 for g in pool[0].configs)  # the fallback holds the longest sequence
    plan = Planner(COST, GPUS, pool).plan(lengths)
    plan.validate(COST, GPUS)
    home = next(r for r, rp in enumerate(plan.replicas) if any(0 in mb for mb in rp.micro_batches))
    assert plan.deployment.configs[home].cp > 1 and plan.lengths[0] == PLAIN_CAP + 20_000


def test_without_long_sequences_a_cp_profile_proposes_as_one_without_cp():
    """CP pays only on long sequences: for short ones the pool is the one the cp = 1 profile proposes."""
    rng = np.random.default_rng(0)
    sample = [rng.integers(100, 4000, 300) for _ in range(3)]
    plain = load_cost_model("llama-7b@a800-80g")
    with_cp = propose(COST, CLUSTER, sample, max_pool=3).pool.deployments
    without = propose(plain, CLUSTER, sample, max_pool=3).pool.deployments
    assert all(g.cp == 1 for d in with_cp for g in d.configs)
    assert [str(d) for d in with_cp] == [str(d) for d in without]


def test_megatron_on_a_cp_profile_is_static_cp():
    lengths = np.array([PLAIN_CAP + 20_000, 90_000] + [3000] * 60)
    ctx = PolicyContext.build(COST, CLUSTER, [lengths])
    plan = make_policy("megatron", ctx).schedule(lengths).phases[0]
    configs = set(plan.deployment.configs)
    assert len(configs) == 1 and next(iter(configs)).cp > 1  # every replica the same (tp, pp, cp)
    plan.validate(COST, GPUS)


def test_overlong_auto_keeps_what_the_pool_holds_and_split_makes_pieces():
    lengths = np.array([100, 250_000, 900])
    kept = apply_overlong(lengths, 300_000, "tp8pp1cp4", "auto")
    assert kept.changed == 0 and kept.lengths.tolist() == [100, 250_000, 900]
    with pytest.raises(Exception, match="250000 tokens is longer than the largest cap 100000 "):
        apply_overlong(lengths, 100_000, "tp8pp1cp2", "auto")
    split = apply_overlong(lengths, 100_000, "tp8pp1cp2", "split")
    assert split.changed == 1 and split.lengths.tolist() == [100, 100_000, 100_000, 50_000, 900]


# -- through the real command -----------------------------------------------------------------------------


def _workload(path, batches):
    path.write_text(json.dumps({"schema": "hydraulis.workload/1", "name": path.stem, "batches": batches}))
    return path



def test_plan_keeps_a_document_whole_on_a_cp_replica(cli, tmp_path):
    from hydraulis.planner.plan import load_plan

    long = PLAIN_CAP + 20_000
    w = _workload(tmp_path / "w.json", [[long, 3000, 500] * 2 + [700] * 30])
    out = tmp_path / "plan.json"
    res = cli("plan", "--profile", "llama-7b@a800-80g+cp", "--gpus", str(GPUS), "--workload", str(w), "--out", str(out))
    assert res.returncode == 0, res.stderr
    plan = load_plan(out).iterations[0]
    assert plan.lengths.count(long) == 2
    assert any(g.cp > 1 for p in plan.phases if long in p.lengths for g in p.deployment.configs)
    sim = cli("simulate", "--plan", str(out), "--json")  # the +cp profile reloads by its name
    assert sim.returncode == 0, sim.stderr
    assert abs(json.loads(sim.stdout)["iterations"][0]["iteration_time_s"] - plan.iteration_time_s) < 1e-9


def test_plan_refuses_what_even_the_largest_cp_replica_cannot_hold(cli, tmp_path):
    out = tmp_path / "plan.json"
    w = _workload(tmp_path / "w.json", [[100, 5_000_000]])
    res = cli("plan", "--profile", "llama-7b@a800-80g+cp", "--gpus", str(GPUS), "--workload", str(w), "--out", str(out))
    one_line_error(res, "5000000 tokens", "largest cap", "cp")
    assert not out.exists()
    # Without CP configs the same document names the way out.
    w = _workload(tmp_path / "w2.json", [[100, PLAIN_CAP + 20_000]])
    res = cli("plan", "--gpus", str(GPUS), "--workload", str(w), "--out", str(out))
    one_line_error(res, f"{PLAIN_CAP + 20_000} tokens", "split", "--profile llama-7b@a800-80g+cp")
    assert not out.exists()
    res = cli("plan", "--gpus", str(GPUS), "--workload", str(w), "--out", str(out), "--overlong", "split")
    assert res.returncode == 0, res.stderr
    assert "split 1 sequence(s)" in res.stderr


@pytest.mark.parametrize(
    ("pool", "needle"),
    [("1x(tp12,pp1,cp2) + 1x(tp8,pp1)", "TP group of 12 GPUs"), ("1x(tp8,pp1,cp3) + 1x(tp8,pp1)", "tp8pp1cp3")],
)
def test_bad_cp_pools_are_one_line(cli, tmp_path, pool, needle):
    out = tmp_path / "plan.json"
    w = _workload(tmp_path / "w.json", [[100, 200]])
    res = cli(
        "plan",
        "--profile",
        "llama-7b@a800-80g+cp",
        "--gpus",
        str(GPUS),
        "--workload",
        str(w),
        "--pool",
        pool,
        "--out",
        str(out),
    )
    one_line_error(res, needle)
    assert not out.exists()


def test_workload_keeps_documents_longer_than_every_tp_pp_cap_whole_for_a_cp_pool(cli, tmp_path):
    from hydraulis.data.workload import load_workload
    from hydraulis.planner.plan import load_plan

    long = PLAIN_CAP + 30_000  # bytes tokenizer: one token per byte, and an end-of-document token
    docs = ["x" * (long - 1), "y" * (2 * long + 5)] + ["w " * (100 * (i % 50) + 10) for i in range(300)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
    corpus = tmp_path / "c"
    assert cli("data", "build", str(src), "--out", str(corpus), "-t", "bytes").returncode == 0
    w = tmp_path / "w.json"
    res = cli("workload", "-c", str(corpus), "-T", str(4 * long), "-k", "2", "-L", str(long + 10), "--out", str(w))
    assert res.returncode == 0, res.stderr
    lengths = np.concatenate(load_workload(w).batches)
    assert (lengths == long).sum() == 1 and lengths.max() == long + 10  # whole, and the longer one split at max_len
    out = tmp_path / "plan.json"
    res = cli("plan", "--profile", "llama-7b@a800-80g+cp", "--gpus", str(GPUS), "--workload", str(w), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert sum(it.lengths.count(long) for it in load_plan(out).iterations) == 1
