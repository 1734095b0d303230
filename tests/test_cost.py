from __future__ import annotations

import json
import time

import numpy as np
import pytest

from hydraulis.cost import AnalyticCostModel, ProfiledCostModel, load_cost_model
from hydraulis.cost.fit import fit_coefficients
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.specs import get_device, get_model

P = ParallelConfig


@pytest.mark.parametrize(("config", "cap"), [(P(1, 2), 11264), (P(2, 1), 21888), (P(4, 1), 46080), (P(8, 1), 85248)])
def test_7b_caps_follow_design(config, cap):
    assert load_cost_model("llama-7b@a800-80g").cap(config, 32) == cap


def test_caps_are_multiples_of_128_and_grow_with_sharding():
    cost = load_cost_model("llama-13b@a800-80g")
    caps = cost.caps(64)
    assert all(v % 128 == 0 for v in caps.values())
    assert caps[P(8, 1)] > caps[P(4, 1)] > caps[P(2, 1)]
    # More GPUs shard the optimizer states thinner: caps never shrink.
    assert all(cost.cap(c, 64) >= cost.cap(c, 16) for c in caps)


def test_stage_time_is_the_quadratic_form():
    cost = load_cost_model("llama-7b@a800-80g")
    c = cost.coefficients(P(2, 1))
    s = np.array([100, 2000, 4096])
    assert cost.stage_time(P(2, 1), s) == pytest.approx(c.a * (s**2).sum() + c.b * s.sum() + c.c)
    assert c.c == pytest.approx(65.1789772727277e-3)


def test_cost_matrix_is_vectorised_and_fast():
    cost = AnalyticCostModel(get_model("llama-70b"), get_device("h100-80g"))
    lengths = np.random.default_rng(0).integers(1, 32768, size=100_000)
    configs = cost.configs[:20]
    t0 = time.perf_counter()
    m = cost.cost_matrix(lengths, configs)
    elapsed = time.perf_counter() - t0
    assert m.shape == (20, 100_000)
    assert np.allclose(m[3], cost.seq_costs(configs[3], lengths))
    assert elapsed < 1.0  # milliseconds in practice; generous for loaded CI machines


def test_analytic_agrees_with_published_profile():
    profiled = load_cost_model("llama-7b@a800-80g")
    analytic = AnalyticCostModel(profiled.model, profiled.device)
    for config in (P(1, 2), P(2, 1), P(4, 1), P(8, 1)):
        assert analytic.cap(config, 32) == pytest.approx(profiled.cap(config, 32), rel=0.05)
        s = [8192]
        assert analytic.stage_time(config, s) == pytest.approx(profiled.stage_time(config, s), rel=0.3)


def test_min_efficient_tokens():
    cost = load_cost_model("llama-7b@a800-80g")
    assert cost.min_efficient_tokens(P(8, 1)) == 1024
    assert cost.min_efficient_tokens(P(2, 2)) == 512


def test_fit_recovers_coefficients():
    rng = np.random.default_rng(1)
    mbs = [list(rng.integers(64, 4096, size=rng.integers(1, 6))) for _ in range(40)]
    a, b, c = 2e-9, 9e-5, 0.02
    times = [a * sum(s * s for s in mb) + b * sum(mb) + c for mb in mbs]
    fit = fit_coefficients(mbs, times)
    assert fit.a == pytest.approx(a, rel=1e-6)
    assert fit.b == pytest.approx(b, rel=1e-6)
    assert fit.c == pytest.approx(c, rel=1e-6)


def _profile_dict():
    return json.loads(
        (
            ProfiledCostModel.preset.__func__.__globals__["resources"].files("hydraulis.cost")
            / "profiles"
            / "llama-7b-a800.json"
        ).read_text()
    )


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("time_ms"), "missing field 'time_ms'"),
        (lambda d: d["time_ms"][0].update(a="fast"), r"time_ms\[0\]\.a: expected a finite number"),
        (lambda d: d["time_ms"][0].update(tp=-1), r"time_ms\[0\]\.tp: must be at least 1"),
        (lambda d: d["memory"].pop("safety_margin_bytes"), "safety_margin_bytes"),
        (lambda d: d.update(schema="other/1"), "schema is 'other/1'"),
        (lambda d: d["time_ms"].append(dict(d["time_ms"][0])), "appears twice"),
        (
            lambda d: d["memory"]["activation_bytes_per_token_hidden_layer"].update({"2": 0}),
            r"activation_bytes_per_token_hidden_layer\.2: must be positive",
        ),
    ],
)
def test_malformed_profile_is_named(tmp_path, mutate, message):
    data = _profile_dict()
    mutate(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HydraulisError, match=message):
        ProfiledCostModel.from_file(path)


def test_not_json_names_line(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"schema": "hydraulis.profile/1",\n oops}')
    with pytest.raises(HydraulisError, match="line 2"):
        load_cost_model(str(path))


def test_a_profile_without_per_micro_batch_overhead_plans():
    """c = 0 is a valid measurement: dispatch then packs as many micro-batches as the caps allow."""
    from hydraulis.planner.planner import Planner
    from hydraulis.specs import ClusterSpec

    data = _profile_dict()
    for row in data["time_ms"]:
        row["c"] = 0.0
    cost = ProfiledCostModel.from_dict(data)
    pool = [Deployment.parse(t, ClusterSpec(16)) for t in ("4x(tp2,pp2)", "2x(tp2,pp4)")]
    lengths = np.random.default_rng(0).integers(100, 6000, 80)
    plan = Planner(cost, 16, pool).plan(lengths)
    plan.validate(cost, 16)
    assert np.isfinite(plan.predicted_time_s) and plan.predicted_time_s > 0


def test_analytic_context_parallelism_splits_per_token_work_too():
    configs = [ParallelConfig(2, 1), ParallelConfig(2, 1, 2)]
    cost = AnalyticCostModel(get_model("llama-7b"), get_device("a800-80g"), configs=configs)
    one, two = cost.coefficients(configs[0]), cost.coefficients(configs[1])
    assert two.a == pytest.approx(one.a / 2)
    assert two.b == pytest.approx(one.b / 2)
    assert two.c == one.c


def test_lower_bound_without_a_config_that_fits_is_a_clear_error():
    from hydraulis.planner.bounds import lower_bound

    cost = load_cost_model("llama-7b@a800-80g")  # its smallest config takes 2 GPUs
    with pytest.raises(HydraulisError, match="no parallel config of llama-7b@a800-80g fits 1 GPU"):
        lower_bound(np.array([100, 200]), cost, 1)
    assert lower_bound(np.array([100, 200]), cost, 2) > 0


def test_recompute_raises_the_cap_and_costs_a_forward():
    from hydraulis.cost import AnalyticCostModel
    from hydraulis.cost.model import RECOMPUTE_TIME
    from hydraulis.parallel import ParallelConfig
    from hydraulis.specs import get_device, get_model

    cost = AnalyticCostModel(get_model("llama-7b"), get_device("a800-80g"))
    g, other = ParallelConfig(2, 1), ParallelConfig(4, 1)
    rc = cost.with_recompute([g])
    assert rc.cap(g, 32) > 2 * cost.cap(g, 32)
    assert rc.cap(other, 32) == cost.cap(other, 32)
    i = cost.index(g)
    assert rc.a[i] == pytest.approx(cost.a[i] * RECOMPUTE_TIME) and rc.b[i] == pytest.approx(cost.b[i] * RECOMPUTE_TIME)
    assert rc.c[i] == cost.c[i] and cost.recompute == frozenset() and rc.recompute == {g}
    whole = AnalyticCostModel(get_model("llama-7b"), get_device("a800-80g"), recompute=True)
    assert whole.recompute == set(whole.configs) and whole.cap(g, 32) == rc.cap(g, 32)
