"""Strategy proposal: the pool it builds, the pool file, and `hydraulis propose` through the real command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hydraulis.cost import load_cost_model
from hydraulis.data.synthetic import get_mixture
from hydraulis.data.workload import sample_batches
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.phases import PhasedPlanner
from hydraulis.planner.planner import Planner
from hydraulis.planner.pool import Pool, has_room, load_pool, save_pool
from hydraulis.planner.proposal.propose import _without_idle, greedy_pool, propose, tokens_per_deployment
from hydraulis.specs import ClusterSpec

COST = load_cost_model("llama-7b@a800-80g")


def batches(mixture: str, max_length: int, tokens: int, k: int, seed: int) -> list[np.ndarray]:
    lengths, probs = get_mixture(mixture).histogram(max_length)
    return sample_batches(lengths, probs, tokens, k, seed)


@pytest.fixture(scope="module")
def wiki16():
    cluster = ClusterSpec(16)
    train = batches("wiki", 16384, 131072, 6, 1)
    return cluster, train, propose(COST, cluster, train, max_pool=4)


def test_pool_starts_with_a_fallback_that_holds_everything(wiki16):
    cluster, train, result = wiki16
    pool = result.pool
    assert 1 <= len(pool.deployments) <= 4
    fallback = pool.deployments[0]
    assert fallback.is_homogeneous
    longest = max(int(b.max()) for b in train)
    assert COST.cap(fallback.configs[0], 16) >= longest
    for d in pool.deployments:
        d.validate(cluster)
    assert pool.usage is not None and sum(pool.usage) == pytest.approx(1.0)
    assert result.times_s.shape == (len(pool.deployments), result.sample_tokens.size)


def test_pool_is_never_slower_than_its_fallback(wiki16):
    """Batch by batch, planning on the whole pool never loses to planning on its fallback alone."""
    _, train, result = wiki16
    with_pool = Planner(COST, 16, result.pool.deployments)
    alone = Planner(COST, 16, result.pool.deployments[:1])
    for b in train:
        assert with_pool.plan(b).predicted_time_s <= alone.plan(b).predicted_time_s + 1e-12


def test_proposed_pool_beats_the_fallback_on_fresh_batches(wiki16):
    cluster, _, result = wiki16
    test = batches("wiki", 16384, 131072, 4, 7)
    with_pool = Planner(COST, 16, result.pool.deployments)
    alone = Planner(COST, 16, result.pool.deployments[:1])
    t_pool = sum(with_pool.plan(b).predicted_time_s for b in test)
    t_alone = sum(alone.plan(b).predicted_time_s for b in test)
    assert t_pool <= t_alone + 1e-9


def test_a_deployment_that_runs_no_samples_tokens_leaves_the_pool_and_the_samples_plan_no_slower(wiki16):
    """The pool's usage is each deployment's share of the samples' tokens, whole or in phases (adding up to 1);
    one the planner gives none of them (2x(tp8,pp1): few, slow replicas) is dropped,
    the samples planned again on the rest exactly as fast."""
    cluster, train, result = wiki16
    assert result.tokens_on.sum() == pytest.approx(result.sample_tokens.sum())
    assert list(result.pool.usage) == pytest.approx(list(result.tokens_on.sum(axis=1) / result.sample_tokens.sum()))
    assert all(u > 0 for u in result.pool.usage[1:])  # the fallback alone may run none (it holds every batch)
    sample = train[: result.sample_tokens.size]
    idle = Deployment.parse("2x(tp8,pp1)", cluster)
    pool = (*result.pool.deployments, idle)
    schedules = [PhasedPlanner(COST, 16, list(pool)).schedule(b) for b in sample]
    assert tokens_per_deployment(pool, schedules)[-1].sum() == 0  # not vacuous: it runs none of them
    kept, again = _without_idle(COST, cluster, pool, schedules, sample)
    assert kept == result.pool.deployments
    assert sum(s.iteration_time_s for s in again) <= sum(s.iteration_time_s for s in schedules) + 1e-12


def test_published_method_gives_distinct_dp_deployments():
    cluster = ClusterSpec(16)
    result = propose(COST, cluster, batches("code", 16384, 131072, 4, 3), max_pool=5, method="published")
    texts = [str(d) for d in result.pool.deployments]
    assert len(set(texts)) == len(texts) <= 5
    assert result.pool.deployments[0].is_homogeneous


def test_greedy_pool_picks_complementary_rows():
    times = np.array([[10.0, 10.0, 10.0], [5.0, 20.0, 20.0], [20.0, 5.0, 20.0], [6.0, 6.0, 30.0]])
    # Row 3 lowers two batches at once (gain 8), then rows 1 and 2 each shave one batch.
    assert greedy_pool(times, 0, 4) == [0, 3, 1, 2]
    assert greedy_pool(times, 0, 1) == [0]


def test_pool_file_round_trips(tmp_path, wiki16):
    cluster, _, result = wiki16
    path = tmp_path / "pool.json"
    save_pool(path, result.pool)
    back = load_pool(path, cluster)
    assert [str(d) for d in back.deployments] == [str(d) for d in result.pool.deployments]
    assert [r.devices for d in back.deployments for r in d.replicas] == [
        r.devices for d in result.pool.deployments for r in d.replicas
    ]
    assert back.usage == pytest.approx(result.pool.usage, abs=1e-4)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(num_gpus=32), "the pool is for 32 GPUs but --gpus is 16"),
        (lambda d: d["deployments"][0]["replicas"][0].update(devices=[0, 0]), "used by two replicas"),
        (lambda d: d.update(deployments=[]), "at least one deployment"),
        (lambda d: d["deployments"][0].update(replicas="x"), "expected a list"),
    ],
)
def test_bad_pool_file_is_named(tmp_path, mutate, message):
    cluster = ClusterSpec(16)
    path = tmp_path / "pool.json"
    save_pool(path, Pool("p", cluster, (Deployment.parse("8x(tp2,pp1)", cluster),)))
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))
    with pytest.raises(HydraulisError, match=message):
        load_pool(path, cluster)


def test_propose_and_plan_through_the_command(cli, tmp_path):
    lengths, probs = get_mixture("wiki").histogram(16384)
    workload = tmp_path / "w.json"
    workload.write_text(
        json.dumps(
            {
                "schema": "hydraulis.workload/1",
                "name": "wiki",
                "lengths": lengths.tolist(),
                "counts": probs.tolist(),
                "tokens_per_batch": 131072,
                "num_batches": 4,
                "seed": 0,
            }
        )
    )
    pool = tmp_path / "pool.json"
    res = cli("propose", "-n", "16", "-w", str(workload), "-o", str(pool), "--max-pool", "3", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert 1 <= len(out["deployments"]) <= 3
    assert out["tokens_per_s"] >= out["fallback_tokens_per_s"]
    plan = tmp_path / "plan.json"
    res = cli("plan", "-n", "16", "-w", str(workload), "--pool", str(pool), "-o", str(plan))
    assert res.returncode == 0, res.stderr
    chosen = {it["deployment"] and json.dumps(it["deployment"]) for it in json.loads(plan.read_text())["iterations"]}
    assert chosen
    # The same pool file for another GPU count is refused, and nothing is written.
    bad = tmp_path / "bad.json"
    res = cli("plan", "-n", "32", "-w", str(workload), "--pool", str(pool), "-o", str(bad))
    assert res.returncode == 2 and "the pool is for 16 GPUs but --gpus is 32" in res.stderr
    assert not bad.exists()


def test_fluid_estimate_of_a_homogeneous_deployment_is_its_share_of_the_work():
    from hydraulis.planner.proposal.screen import fluid_estimates

    cluster = ClusterSpec(16)
    deployment = Deployment.parse("8x(tp2,pp1)", cluster)
    batch = np.array([1000] * 64)
    (est,) = fluid_estimates(COST, cluster, [deployment], [batch])[:, 0]
    k = COST.coefficients(deployment.configs[0])
    cap = COST.cap(deployment.configs[0], 16)
    work = k.a * (batch**2).sum() + k.b * batch.sum() + k.c * batch.sum() / cap
    assert est == pytest.approx(work / 8, rel=1e-6)


def test_screening_falls_back_to_the_fluid_proxy_past_its_budget(monkeypatch):
    import hydraulis.planner.proposal.screen as screen

    calls = []
    real = screen.fluid_estimates

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out.shape)
        return out

    monkeypatch.setattr(screen, "SCREEN_SEQUENCES", 1)
    monkeypatch.setattr(screen, "fluid_estimates", recording)
    cluster = ClusterSpec(32)
    train = batches("code", 32768, 262144, 3, 5)
    result = propose(COST, cluster, train, max_pool=3)
    assert calls and calls[0][0] > 30  # every candidate got a fluid estimate
    assert 1 <= len(result.pool.deployments) <= 3
    result.pool.deployments[0].validate(cluster)


def test_the_screen_takes_the_fluid_proxy_by_the_sequences_it_would_dispatch_not_by_a_clock(monkeypatch):
    """Past SCREEN_SEQUENCES sequences dispatched (every candidate on the first batch, about as many again in the
    halving rounds) the fluid LP picks whom to dispatch, at that count exactly: a count, not a timed call, so the
    pool does not move with the machine."""
    import hydraulis.planner.proposal.screen as screen
    from hydraulis.planner.pool import candidate_deployments

    real, calls = screen.fluid_estimates, []

    def recording(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(screen, "fluid_estimates", recording)
    cluster = ClusterSpec(32)
    train = batches("code", 32768, 262144, 2, 5)
    candidates = candidate_deployments(COST, cluster, int(max(b.max() for b in train)), train)
    assert len(candidates) > 12
    for afford, taken in ((len(candidates), False), (len(candidates) - 1, True)):
        calls.clear()
        monkeypatch.setattr(screen, "SCREEN_SEQUENCES", 2 * len(train[0]) * afford)
        screen.screen_candidates(COST, cluster, candidates, train, keep=len(candidates) // 4)
        assert bool(calls) is taken


def test_under_a_memory_budget_deep_replicas_are_proposed_for_the_long_documents(cli, tmp_path):
    """tiny@cpu-measured, fp32, 50 MiB per rank: a tp1 replica holds 2,176 tokens, so documents up to 3,072
    need a deeper or a wider replica. On this profile p2p is cheap (129 us) and a tp2 micro-batch pays about
    41 ms of collectives: the proposal holds the long documents on pipelined tp1 replicas."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(6.7, 0.9, 4000).astype(np.int64) + 16, 3072)
    batches_ = [lengths[i : i + 9].tolist() for i in range(0, 9 * 12, 9)]
    assert all(max(b) <= 3072 for b in batches_) and sum(max(b) > 2176 for b in batches_) >= 3
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"schema": "hydraulis.workload/1", "name": "tail", "batches": batches_}))
    args = ("-p", "tiny@cpu-measured", "-n", "4", "-w", str(workload), "--max-pool", "3", "--json")
    res = cli("propose", *args, "-o", str(tmp_path / "pool.json"), "--memory-per-rank", "50MiB", "--dtype", "fp32")
    assert res.returncode == 0, res.stderr
    used = [d for d in json.loads(res.stdout)["deployments"] if d["usage"] > 0]
    # A deployment with a pipelined tp1 replica is proposed and used for long documents (its lone micro-batch
    # holds 3,968 tokens). Other batches may go to a wide tp2 replica beside tp1 ones: on shared cores a
    # pipeline's bubbles lend their cores (sim.shared_timelines), which makes the two close.
    deep = [d for d in used if "(tp1,pp2)" in d["deployment"] or "(tp1,pp4)" in d["deployment"]]
    assert deep and sum(d["usage"] for d in deep) >= 0.25, used


def test_the_published_pool_holds_the_longest_sequence_by_the_plain_cap():
    """The published system runs no lone micro-batches (hydraulis-reference packs to the cap): its fallback
    must hold the longest sequence by the cap. On the bench's 7b-64g-wiki batches hydraulis's fallback is
    tp2 x cp2, which holds 32,768 tokens only alone (its cap is 32,640)."""
    from hydraulis.bench import get_scenarios

    scenario = get_scenarios(["7b-64g-wiki-1m-32k"])[0]
    cost, cluster = load_cost_model(scenario.profile), ClusterSpec(scenario.num_gpus)
    sample = scenario.sample(scenario.seed + 1000, 8)
    assert max(int(b.max()) for b in sample) == 32768
    fallback = propose(cost, cluster, sample, method="published", max_pool=1, max_samples=1).pool.deployments[0]
    assert all(cost.cap(g, cluster.num_gpus) >= 32768 for g in fallback.configs), str(fallback)


def test_the_published_pool_has_room_for_the_32b_bench_batches_it_did_not_sample():
    """benchmarks/proposal.py --quick crashed on 32b-64g-wiki ('no deployment of the pool has room'): the
    published fallback was 4x(tp4,pp2,cp2), which holds 32,768 tokens only as a lone micro-batch (cap
    21,120), and a fresh batch had more sequences beyond that cap than it has replicas. Held by the plain
    cap, the fallback runs any batch of sequences up to the longest."""
    from hydraulis.bench import get_scenarios

    scenario = get_scenarios(["32b-64g-wiki-1m-32k"])[0]
    cost, cluster = load_cost_model(scenario.profile), ClusterSpec(scenario.num_gpus)
    train, fresh = scenario.sample(scenario.seed + 1000, 4), scenario.sample(scenario.seed, 3)
    longest = max(int(b.max()) for b in train + fresh)
    pool = propose(cost, cluster, train, method="published", max_length=longest).pool.deployments
    old = ParallelConfig(4, 2, 2)  # the old fallback: too few replicas for the fresh batch's long sequences
    assert cost.cap(old, 64) < longest <= cost.lone_cap(old, 64)
    assert has_room(cost, old, 64, train) and not has_room(cost, old, 64, fresh)
    assert all(cost.cap(g, cluster.num_gpus) >= longest for g in pool[0].configs), str(pool[0])
    planner = Planner(cost, cluster.num_gpus, pool[:1])
    assert all(planner.plan(b).deployment == pool[0] for b in fresh[:1])


def test_least_trips_is_the_least_slowest_trip_over_every_shape():
    """`_least_trips` against every choice of one config per sequence (the GPUs left to the last one's config):
    the same least slowest trip, then the same least GPU time."""
    import itertools

    from hydraulis.planner.proposal.phased import _least_trips

    rng = np.random.default_rng(3)
    sizes = np.array([4, 8, 8, 16, 32])
    for _ in range(30):
        k = int(rng.integers(1, 4))
        trips = np.where(rng.random((k, len(sizes))) < 0.2, np.inf, rng.random((k, len(sizes))) * 10)
        best = None
        for shape in itertools.product(range(len(sizes)), repeat=k):
            used, last = int(sizes[list(shape)].sum()), sizes[shape[-1]]
            values = trips[np.arange(k), list(shape)]
            if used <= 32 and (32 - used) % last == 0 and np.isfinite(values).all():
                key = (float(values.max()), float((sizes[list(shape)] * values).sum()))
                best = key if best is None or key < best else best
        got = _least_trips(trips, sizes, 32)
        if best is None:
            assert got == []
            continue
        assert sum(int(sizes[j]) for j in got) == 32
        firsts = got[-k:][::-1]  # one per sequence, longest first; the fill before them
        values = trips[np.arange(k), firsts]
        assert (float(values.max()), float((sizes[firsts] * values).sum())) == pytest.approx(best)


def test_a_long_phase_shaped_for_the_longest_enters_the_pool_where_it_pays():
    """7B on 64 GPUs, a batch with one 262K sequence, three of 80-100K and short ones, on a pool of 1x tp8pp1cp8
    (holds the 262K) and 32x tp2pp1 (the short ones): the long phase shaped for the 4 longest gives the 262K a
    wide replica and the next ones narrower ones, the greedy adds it, and the batch runs at least 5% faster.
    On the batch with the 262K alone or with none, the greedy's schedule is never slower than the pool's, and the
    pool stays as it was where the move saves nothing."""
    from hydraulis.planner.proposal.phased import _greedy_phases, long_deployments

    cost = load_cost_model("llama-7b@a800-80g+cp").with_policies(True)
    cluster = ClusterSpec(64)
    configs = [ParallelConfig.parse(t) for t in ("tp8pp1cp8", "tp8pp1cp4", "tp4pp1cp2", "tp2pp1cp4", "tp2pp1")]
    pool = [Deployment.parse(t, cluster) for t in ("1x(tp8,pp1,cp8)", "32x(tp2,pp1)")]
    rng = np.random.default_rng(0)
    batch = np.concatenate([[262144, 100000, 90000, 80000], rng.integers(1000, 16000, 40)])
    shaped = long_deployments(cost, cluster, configs, [batch], tops=(4,))
    assert len(shaped) == 1 and len(set(shaped[0].configs)) > 1, shaped
    widest = max(shaped[0].configs, key=lambda g: g.num_gpus)
    assert widest.num_gpus > min(g.num_gpus for g in shaped[0].configs)
    before = PhasedPlanner(cost, 64, pool).schedule(batch).iteration_time_s
    current, schedules = _greedy_phases(cost=cost, num_gpus=64, current=pool, moves=[(tuple(shaped), 0, False)],
                                        sample=[batch], max_pool=4, min_gain=0.002)
    assert current == [*pool, shaped[0]]
    assert schedules[0].iteration_time_s < 0.95 * before
    assert any(p.deployment == shaped[0] for p in schedules[0].phases)
    for other in (np.concatenate([[262144], batch[4:]]), batch[4:]):  # never slower: added only where it pays
        base = PhasedPlanner(cost, 64, pool).schedule(other).iteration_time_s
        current, schedules = _greedy_phases(cost=cost, num_gpus=64, current=pool,
                                            moves=[(tuple(shaped), 0, False)], sample=[other], max_pool=4,
                                            min_gain=0.002)
        assert schedules[0].iteration_time_s <= base
        assert (current == pool) == (schedules[0].iteration_time_s == base)


def test_least_gpu_time_is_the_least_work_over_every_shape():
    """`_least_gpu_time` against every choice of one allowed config per sequence on at most 32 GPUs whose rest the
    fill's size divides: the same least total work."""
    import itertools

    from hydraulis.planner.proposal.phased import _least_gpu_time

    rng = np.random.default_rng(5)
    sizes = np.array([4, 8, 8, 16, 32])
    for _ in range(30):
        k, fill = int(rng.integers(1, 4)), int(rng.choice([4, 8]))
        work = np.where(rng.random((k, len(sizes))) < 0.3, np.inf, rng.random((k, len(sizes))) * 100)
        best = min((float(work[np.arange(k), list(shape)].sum()) for shape in itertools.product(range(len(sizes)),
                    repeat=k) if (used := int(sizes[list(shape)].sum())) <= 32 and (32 - used) % fill == 0
                    and np.isfinite(work[np.arange(k), list(shape)]).all()), default=None)
        got = _least_gpu_time(work, sizes, 32, fill)
        if best is None:
            assert got == []
            continue
        assert len(got) == k and int(sizes[got].sum()) <= 32 and (32 - int(sizes[got].sum())) % fill == 0
        assert float(work[np.arange(k), got].sum()) == pytest.approx(best)


def test_a_long_phase_within_the_bound_runs_bulk_work_beside_the_longest():
    """7B on 64 GPUs, a batch of a 150K and a 100K sequence beside 70 of 2-24K, on a pool of 1x tp8pp1cp8 (the
    150K's least trip) and 8x tp2pp1cp4 (the bulk): the budgeted shape gives each of the 2 longest the config of
    least GPU time whose lone trip fits the batch's bound LB*, so not the widest, and the rest to the bulk's
    config; the batch runs at least 5% faster with it beside the pool, and faster than with the shape of the least
    trips (`long_deployments`), whose replicas run those two alone."""
    from hydraulis.planner.bounds import lower_bound
    from hydraulis.planner.proposal.phased import budget_deployments, long_deployments
    from hydraulis.planner.replicas import ReplicaCost

    cost = load_cost_model("llama-7b@a800-80g+cp").with_policies(True)
    cluster = ClusterSpec(64)
    configs = [ParallelConfig.parse(t) for t in ("tp8pp1cp8", "tp8pp1cp4", "tp8pp1cp2", "tp4pp1cp2", "tp2pp1cp4",
                                                 "tp2pp1")]
    pool = [Deployment.parse(t, cluster) for t in ("1x(tp8,pp1,cp8)", "8x(tp2,pp1,cp4)")]
    batch = np.concatenate([[150000, 100000], np.random.default_rng(0).integers(2000, 24000, 70)])
    schedule = PhasedPlanner(cost, 64, pool).schedule(batch)
    [shape] = budget_deployments(cost, cluster, configs, [batch], [schedule], tops=(2,))
    budget = lower_bound(batch, cost, 64)
    for length, g in zip((150000, 100000), shape.configs, strict=False):  # the widest first, as placed
        r = ReplicaCost.of(cost, g, 64)
        assert r.pp * (r.least(np.array([length]))[0] + r.c) <= budget
    assert max(g.num_gpus for g in shape.configs) < 64 and ParallelConfig.parse("tp2pp1cp4") in shape.configs
    with_shape = PhasedPlanner(cost, 64, [*pool, shape]).schedule(batch).iteration_time_s
    [fastest] = long_deployments(cost, cluster, configs, [batch], tops=(2,))
    assert with_shape < 0.95 * schedule.iteration_time_s
    assert with_shape < PhasedPlanner(cost, 64, [*pool, fastest]).schedule(batch).iteration_time_s
