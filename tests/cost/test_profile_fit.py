"""The profiler's torch-free parts: robust fits, held-out fidelity, measured links in the cost model."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import ProfiledCostModel
from hydraulis.cost.fit import fidelity, fit_link, fit_robust, holdout_fidelity, holdout_split
from hydraulis.cost.model import Link
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.specs import ClusterSpec


def sweep() -> list[list[int]]:
    """The profiler's kind of sweep: one long document vs many short ones of the same total."""
    return [[total // k] * k for total in (256, 512, 1024, 2048, 4096) for k in (1, 2, 4, 8) if total // k >= 64]


@settings(max_examples=30, deadline=None)
@given(
    a=st.floats(1e-9, 1e-6),
    b=st.floats(1e-6, 1e-3),
    c=st.floats(1e-4, 5e-2),
    seed=st.integers(0, 2**31 - 1),
)
def test_fit_recovers_known_coefficients_from_noisy_timings(a, b, c, seed):
    rng = np.random.default_rng(seed)
    mbs = sweep()
    true = np.array([a * sum(s * s for s in mb) + b * sum(mb) + c for mb in mbs])
    noisy = true * (1 + rng.normal(0, 0.02, len(true)))
    fit = fit_robust(mbs, noisy)
    predicted = np.array(
        [fit.coefficients.a * sum(s * s for s in mb) + fit.coefficients.b * sum(mb) + fit.coefficients.c for mb in mbs]
    )
    # Times are what the planner consumes: every prediction within five noise widths (2% each). Three widths
    # failed now and then at the sweep's end points, which the fit extrapolates to from few points (6.4% once).
    assert np.max(np.abs(predicted - true) / true) < 0.10
    assert len(fit.residuals) == len(mbs)
    assert min(fit.coefficients.a, fit.coefficients.b, fit.coefficients.c) >= 0


def test_fit_recovers_each_coefficient_and_ignores_an_outlier():
    rng = np.random.default_rng(7)
    a, b, c = 2e-8, 3e-5, 4e-3
    mbs = sweep()
    t = np.array([a * sum(s * s for s in mb) + b * sum(mb) + c for mb in mbs]) * (1 + rng.normal(0, 0.01, len(mbs)))
    t[3] *= 3.0  # one timing disturbed by another process
    fit = fit_robust(mbs, t).coefficients
    assert fit.a == pytest.approx(a, rel=0.1)
    assert fit.b == pytest.approx(b, rel=0.1)
    assert fit.c == pytest.approx(c, rel=0.2)


def test_holdout_fidelity_of_exact_data_is_near_zero():
    mbs = sweep()
    t = [1e-8 * sum(s * s for s in mb) + 2e-5 * sum(mb) + 1e-3 for mb in mbs]
    f = holdout_fidelity(mbs, t)
    assert f["worst_abs_rel_error"] < 1e-3 and f["n"] == round(len(mbs) / 3)
    fit_idx, held = holdout_split(len(mbs))
    assert sorted([*fit_idx, *held]) == list(range(len(mbs)))


def test_fidelity_is_median_and_worst_relative_error():
    f = fidelity([1.1, 2.0, 2.5], [1.0, 2.0, 2.0])
    assert f["median_abs_rel_error"] == pytest.approx(0.1)
    assert f["worst_abs_rel_error"] == pytest.approx(0.25)
    with pytest.raises(HydraulisError):
        fidelity([1.0], [1.0, 2.0])
    with pytest.raises(HydraulisError):
        fidelity([1.0], [0.0])


def test_fit_link_recovers_latency_and_bandwidth():
    sizes = [2.0**k for k in range(10, 24, 2)]
    times = [50e-6 + s / 2e9 for s in sizes]
    latency, bandwidth = fit_link(sizes, times)
    assert latency == pytest.approx(50e-6, rel=0.05)
    assert bandwidth == pytest.approx(2e9, rel=0.05)


def test_measured_collectives_replace_the_device_constants():
    base = ProfiledCostModel.preset("llama-7b@a800-80g")
    data = _preset_dict()
    data["collectives"] = {
        "world_size": 8,
        "all_to_all": {"latency_s": 1e-3, "bandwidth_Bps": 1e9},
        "p2p": {"latency_s": 2e-4, "bandwidth_Bps": 5e8},
    }
    measured = ProfiledCostModel.from_dict(data)
    config = ParallelConfig(2, 2)
    assert measured.p2p_time(config, 4096) == pytest.approx(Link(2e-4, 5e8).time(4096 * 4096 * 2 / 2))
    assert measured.grad_sync_time(8) == pytest.approx(2 * (1e-3 + 2 * measured.model.num_params / 8 / 1e9))
    # Beyond one node the device constants stay; without collectives, today's behaviour.
    assert measured.grad_sync_time(16) == pytest.approx(base.grad_sync_time(16))
    assert base.collectives is None
    del data["collectives"]["p2p"]
    assert ProfiledCostModel.from_dict(data).p2p_time(config, 4096) == pytest.approx(base.p2p_time(config, 4096))
    data["collectives"]["all_to_all"]["bandwidth_Bps"] = 0
    with pytest.raises(HydraulisError, match="bandwidth_Bps"):
        ProfiledCostModel.from_dict(data)


def _preset_dict(name: str = "llama-7b-a800.json") -> dict:
    import json
    from importlib import resources

    path = resources.files("hydraulis.cost") / "profiles" / name
    return copy.deepcopy(json.loads(path.read_text()))


def test_the_shipped_cpu_profile_was_measured_and_plans(cli, tmp_path):
    cost = ProfiledCostModel.preset("tiny@cpu-measured")
    assert cost.model.name == "tiny" and cost.device.name == "cpu"
    assert {c.name for c in cost.configs} == {"tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2", "tp4pp1", "tp1pp4"}
    assert cost.collectives is not None and cost.collectives.world_size == 4
    assert cost.collectives.all_to_all is not None and cost.collectives.p2p is not None
    data = _preset_dict("tiny-cpu-measured.json")
    assert data["memory"]["method"].startswith("cpu: counted tensor bytes")
    for fid in data["fidelity"].values():
        assert 0 <= fid["holdout"]["median_abs_rel_error"] <= fid["holdout"]["worst_abs_rel_error"]
    # Deeper pipelines split the layers: the measured per-stage a falls with pp, once each is taken at
    # the same load (tp1pp4's four ranks were measured sharing the two cores, tp1pp2's two were not).
    shared = cost.shared_cores
    assert shared is not None and shared.busy_ranks[ParallelConfig(1, 4)] == 4
    a = {c.name: cost.coefficients(c).a / shared.load(shared.busy_ranks[c]) for c in cost.configs}
    assert a["tp1pp4"] < a["tp1pp2"] < a["tp1pp1"]
    work = tmp_path / "w.json"
    work.write_text(
        '{"schema": "hydraulis.workload/1", "name": "w", "batches": [[300, 120, 64, 900, 40, 500, 800, 77]]}'
    )
    res = cli("plan", "-p", "tiny@cpu-measured", "-n", "4", "-w", str(work), "--out", str(tmp_path / "plan.json"))
    assert res.returncode == 0, res.stderr


def test_shared_cores_rescale_a_plan_by_the_ranks_it_keeps_busy():
    from hydraulis.parallel import Deployment
    from hydraulis.planner.plan import plan_from_assignment
    from hydraulis.planner.sim import simulate
    from hydraulis.specs import ClusterSpec

    data = _preset_dict("tiny-cpu-measured.json")
    plain_data = copy.deepcopy(data)
    plain_data.pop("shared_cores", None)
    for row in plain_data["time_ms"]:
        row.pop("busy_ranks", None)
    data["shared_cores"] = {"cores": 2, "threads_per_rank": 1}
    for row in data["time_ms"]:
        row["busy_ranks"] = 2  # measured with two ranks computing on the two cores
    shared, plain = ProfiledCostModel.from_dict(data), ProfiledCostModel.from_dict(plain_data)
    dep = Deployment.parse("4x(tp1,pp1)", ClusterSpec(4))
    two = plan_from_assignment(0, [512, 300], dep, [[[0]], [[1]], [], []], 0.0)
    four = plan_from_assignment(0, [300, 300, 300, 300], dep, [[[0]], [[1]], [[2]], [[3]]], 0.0)
    # Two busy ranks on two cores: as measured. Four equal ones: each gets half a core, twice as slow.
    np.testing.assert_allclose(simulate(two, shared).replica_times_s, simulate(two, plain).replica_times_s)
    np.testing.assert_allclose(simulate(four, shared).replica_times_s, 2 * simulate(four, plain).replica_times_s)
    assert simulate(four, shared).grad_sync_s == simulate(four, plain).grad_sync_s
    # Three busy ranks, one replica short (a) and two long (b): all run at 2/3 speed until the short
    # one ends at 1.5a; the long ones have done a, and finish b - a at full speed: b + 0.5a.
    three = plan_from_assignment(0, [100, 900, 900], dep, [[[0]], [[1]], [[2]], []], 0.0)
    a, b = simulate(three, plain).replica_times_s[:2]
    np.testing.assert_allclose(simulate(three, shared).replica_times_s, [1.5 * a, b + 0.5 * a, b + 0.5 * a, 0.0])
    data["time_ms"][0]["busy_ranks"] = 0
    with pytest.raises(HydraulisError, match="busy_ranks"):
        ProfiledCostModel.from_dict(data)


def test_a_measured_optimizer_step_is_the_iteration_time_after_compute():
    from hydraulis.parallel import Deployment
    from hydraulis.planner.plan import plan_from_assignment
    from hydraulis.planner.sim import simulate
    from hydraulis.specs import ClusterSpec

    data = _preset_dict("tiny-cpu-measured.json")
    data.pop("optimizer_step", None)
    estimate = ProfiledCostModel.from_dict(data)
    data["optimizer_step"] = {"world_size": 4, "ms": {"tp1pp1": 20.0, "tp2pp1": 30.0}}
    measured = ProfiledCostModel.from_dict(data)
    hetero = Deployment.parse("1x(tp2,pp1) + 2x(tp1,pp1)", ClusterSpec(4))
    plan = plan_from_assignment(0, [512, 300], hetero, [[[0]], [[1]], []], 0.0)
    res = simulate(plan, measured)
    assert res.grad_sync_s == pytest.approx(0.030)  # the slowest config's measured step
    assert res.iteration_time_s == pytest.approx(res.compute_time_s + 0.030)
    # A config the profile did not measure: the exchange estimate.
    assert measured.step_time(Deployment.parse("2x(tp1,pp2)", ClusterSpec(4)).configs) == estimate.grad_sync_time(4)
    # Another world size on the profile's 2 shared cores: 8 ranks load them twice as much as the 4 measured.
    eight = Deployment.parse("8x(tp1,pp1)", ClusterSpec(8)).configs
    assert data["shared_cores"]["cores"] == 2 and measured.step_time(eight) == pytest.approx(0.040)
    # ... and without shared cores (GPUs) the exchange estimate.
    del data["shared_cores"]
    assert ProfiledCostModel.from_dict(data).step_time(eight) == estimate.grad_sync_time(8)
    data["optimizer_step"]["ms"]["tp9"] = 1.0
    with pytest.raises(HydraulisError, match="tp9"):
        ProfiledCostModel.from_dict(data)


def _with_measured_exchange() -> tuple[dict, ProfiledCostModel, Deployment]:
    """tiny's measured profile with its optimizer step, gather and reduce timed at 4 ranks, the cost model,
    and a heterogeneous deployment of 4 ranks."""
    data = _preset_dict("tiny-cpu-measured.json")
    data["optimizer_step"] = {"world_size": 4, "ms": {"tp1pp1": 20.0, "tp2pp1": 30.0, "tp1pp2": 25.0},
                              "gather_ms": {"tp1pp1": 6.0, "tp2pp1": 5.0, "tp1pp2": 7.0},
                              "reduce_ms": {"tp1pp1": 8.0, "tp2pp1": 9.0, "tp1pp2": 10.0}}  # fmt: skip
    return data, ProfiledCostModel.from_dict(data), Deployment.parse("1x(tp2,pp1) + 2x(tp1,pp1)", ClusterSpec(4))


def test_an_overlapped_exchange_is_inside_each_busy_replica_and_the_iteration_stays():
    """Overlapped, a pp = 1 replica gathers and sends its reduce while it computes, a pipeline only
    sends its reduce (it gathered before its first micro-batch): the trainer's replica times hold that."""
    from hydraulis.planner.plan import plan_from_assignment
    from hydraulis.planner.sim import simulate

    data, cost, hetero = _with_measured_exchange()
    plan = plan_from_assignment(0, [512, 300], hetero, [[[0]], [[1]], []], 0.0)
    plain, overlapped = simulate(plan, cost), simulate(plan, cost.with_overlap(True))
    inside = np.array([0.005 + 0.009, 0.006 + 0.008, 0.0])  # the idle replica does not count
    np.testing.assert_allclose(overlapped.replica_times_s, plain.replica_times_s + inside)
    assert overlapped.iteration_time_s == plain.iteration_time_s
    assert cost.exchange_in_compute(ParallelConfig(1, 2), 4) == pytest.approx(0.010)
    del data["optimizer_step"]["reduce_ms"]  # an older profile: nothing measured to move
    assert ProfiledCostModel.from_dict(data).exchange_in_compute(ParallelConfig(1, 1), 4) == 0.0


def test_a_phase_change_costs_the_measured_reduce_before_and_gather_after():
    """A switch reduces the leaving deployment's gradients and gathers the next one's shard, each timed as the
    profile measured it alone for the slowest config of its deployment; a schedule's switch_s is their mean."""
    from hydraulis.planner.plan import plan_from_assignment
    from hydraulis.planner.schedule import mean_switch_time, phase_switch_time, phases_time

    data, cost, hetero = _with_measured_exchange()
    pipes = Deployment.parse("2x(tp1,pp2)", ClusterSpec(4))
    assert phase_switch_time(cost, 4, hetero.configs, pipes.configs) == pytest.approx(0.009 + 0.007)
    assert phase_switch_time(cost, 4, pipes.configs, hetero.configs) == pytest.approx(0.010 + 0.006)
    assert phase_switch_time(cost, 4) == pytest.approx(0.010 + 0.007)  # not planned yet: the slowest of each
    # At 8 ranks on the profile's 2 shared cores: twice the load of the 4 measured.
    assert phase_switch_time(cost, 8, pipes.configs, pipes.configs) == pytest.approx(2 * (0.010 + 0.007))
    first = plan_from_assignment(0, [300], hetero, [[], [[0]], []], 0.0)
    second = plan_from_assignment(0, [900], pipes, [[[0]], []], 0.0)
    switch = mean_switch_time([first, second, first], cost)
    assert switch == pytest.approx((0.016 + 0.016) / 2) and mean_switch_time([first], cost) == 0.0
    compute = phases_time([first, second, first], cost, 0.0) - cost.step_time(hetero.configs)
    assert phases_time([first, second, first], cost, switch) == pytest.approx(
        compute + 2 * switch + cost.step_time(hetero.configs))
    del data["optimizer_step"]["gather_ms"]  # an older profile: the all-to-all link's estimate
    assert phase_switch_time(ProfiledCostModel.from_dict(data), 4) == cost.grad_sync_time(4)


def test_the_planner_chooses_by_the_whole_simulated_iteration():
    """A deployment whose compute is fastest but whose optimizer step is slow loses to one that is faster overall."""
    from hydraulis.parallel import Deployment
    from hydraulis.planner.planner import Planner
    from hydraulis.planner.sim import simulate
    from hydraulis.specs import ClusterSpec

    data = _preset_dict("tiny-cpu-measured.json")
    data["optimizer_step"] = {"world_size": 4, "ms": {"tp1pp1": 2000.0, "tp2pp1": 1.0}}
    cost = ProfiledCostModel.from_dict(data)
    pool = [Deployment.parse(p, ClusterSpec(4)) for p in ("4x(tp1,pp1)", "2x(tp2,pp1)")]
    lengths = np.array([300, 280, 260, 240, 200, 120])
    planner = Planner(cost, 4, pool)
    on = {str(d): planner.plan_on(lengths, d) for d in pool}
    tp1, tp2 = (simulate(on[str(d)], cost) for d in pool)
    assert tp1.compute_time_s < tp2.compute_time_s  # the trap: faster compute...
    assert tp1.iteration_time_s > tp2.iteration_time_s  # ...slower iteration
    assert str(planner.plan(lengths).deployment) == "2x(tp2,pp1)"
