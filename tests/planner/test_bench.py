"""Synthetic length mixtures, scenarios and `hydraulis bench` through the real command."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hydraulis.bench import (
    LENGTH_SOURCES,
    SCENARIOS,
    Scenario,
    get_scenarios,
    register_length_source,
    run_scenario,
)
from hydraulis.data.synthetic import get_mixture


def quantile(lengths: np.ndarray, probs: np.ndarray, q: float) -> int:
    return int(lengths[np.searchsorted(np.cumsum(probs), q)])


def test_wiki_mixture_matches_public_statistics():
    lengths, probs = get_mixture("wiki").histogram(200_000)
    assert 250 <= quantile(lengths, probs, 0.5) <= 350
    assert 2000 <= quantile(lengths, probs, 0.95) <= 3000
    assert 0.004 <= probs[lengths > 8192].sum() <= 0.008


def test_code_mixture_matches_public_statistics_and_clips():
    lengths, probs = get_mixture("code").histogram(200_000)
    assert 2500 <= quantile(lengths, probs, 0.5) <= 3500
    assert 65_000 <= quantile(lengths, probs, 0.99) <= 95_000
    clipped, p = get_mixture("code").histogram(32768)
    assert clipped.max() == 32768 and abs(p.sum() - 1) < 1e-12 and p[-1] > 0.03


def test_scenarios_cover_the_issue_grid():
    main = get_scenarios(None, "main")
    assert len(main) == 13 and {s.num_gpus for s in main} == {16, 32, 64}
    assert {s.profile.split("@")[0] for s in main} == {"llama-7b", "llama-13b", "llama-32b"}
    assert all(256 * 1024 <= s.tokens_per_batch <= 1024 * 1024 for s in main)
    assert all(8 * 1024 <= s.max_length <= 32 * 1024 for s in main)


def test_long_scenarios_cover_where_the_field_trains():
    long = get_scenarios(None, "long")
    assert {s.max_length // 1024 for s in long} == {64, 128, 256, 512}
    assert {s.profile.split("@")[0] for s in long} == {"llama-7b", "llama-13b", "llama-70b"}
    assert {s.num_gpus for s in long} == {32, 64, 128, 256}
    assert {s.lengths for s in long} == {"python-stdlib", "longmix"} and all(s.name.startswith("long-") for s in long)
    assert get_scenarios(None) == [*get_scenarios(None, "main"), *long]


def test_longmix_matches_prolong_token_shares():
    lengths, probs = get_mixture("longmix").histogram(1 << 20)
    tokens = lengths * probs
    assert 0.55 <= tokens[lengths > 32 * 1024].sum() / tokens.sum() <= 0.62  # 60% of tokens from long documents
    assert 250 <= quantile(lengths, probs, 0.5) <= 450  # most documents are short


def test_a_long_scenario_runs_and_every_policy_is_within_the_bound():
    """The 70B at 64K on 64 GPUs, one small batch, the cheap policies (the proposal's seconds stay in the bench)."""
    s = dataclasses.replace(next(s for s in SCENARIOS if s.name == "long-70b-64g-stdlib-1m-64k"),
                            tokens_per_batch=256 * 1024, batches=1)
    results = run_scenario(s, ["megatron", "flops-balanced", "megatron-dcp"])
    assert [r.policy for r in results] == ["megatron", "flops-balanced", "megatron-dcp"]
    assert all(0 < r.balance_efficiency <= 1 for r in results)


def test_a_new_lengths_source_is_one_registration():
    register_length_source("flat-test", lambda top: (np.arange(100, top + 1), np.ones(top - 99)))
    try:
        s = Scenario("flat", "llama-7b@a800-80g", 16, 64 * 1024, 4096, "flat-test", batches=1)
        results = run_scenario(s, ["megatron", "hydraulis"])
        assert [r.policy for r in results] == ["megatron", "hydraulis"]
        assert results[0].speedup_vs_megatron == 1.0
        assert results[1].tokens_per_s >= 0.99 * results[0].tokens_per_s
        assert 0 < results[1].balance_efficiency <= 1
    finally:
        del LENGTH_SOURCES["flat-test"]


def test_bench_cli_writes_json_and_png(cli, tmp_path):
    res = cli("bench", "--scenario", SCENARIOS[0].name, "--policy", "hydraulis", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["schema"] == "hydraulis.bench/1"
    assert {r["policy"] for r in report["results"]} == {"megatron", "hydraulis"}
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "tokens/s" in res.stdout


def test_bench_rejects_unknown_names(cli, tmp_path):
    for args in (("--scenario", "nope"), ("--policy", "nope")):
        res = cli("bench", *args, "--out", str(tmp_path))
        assert res.returncode == 2 and "nope" in res.stderr and "Traceback" not in res.stderr


def test_plots_without_matplotlib_are_a_clear_error(monkeypatch):
    import sys

    import pytest

    from hydraulis.errors import HydraulisError
    from hydraulis.plots import pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(HydraulisError, match="plotting needs matplotlib"):
        pyplot()


def test_bench_cli_leaves_no_half_result_when_the_plot_fails(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import hydraulis.bench
    import hydraulis.report
    from hydraulis.cli import app
    from hydraulis.errors import HydraulisError

    def broken_plot(report, path):
        raise HydraulisError("plot failed")

    report = {"schema": "hydraulis.bench/1", "scenarios": [], "policies": [], "results": [], "summary": {}}
    monkeypatch.setattr(hydraulis.bench, "run_bench", lambda *a, **k: {**report, "wall_s": 0.0})
    monkeypatch.setattr(hydraulis.report, "bench_plot", broken_plot)
    res = CliRunner().invoke(app, ["bench", "--scenario", SCENARIOS[0].name, "--out", str(tmp_path)])
    assert isinstance(res.exception, HydraulisError)
    assert list(tmp_path.iterdir()) == []


def test_summary_judges_hydraulis_against_the_best_other_policy_of_each_scenario():
    from hydraulis.bench import PolicyResult, summarize
    from hydraulis.report import summary_lines

    def result(scenario: str, policy: str, tps: float) -> PolicyResult:
        return PolicyResult(scenario, policy, tps, 0.8, 1.0, (1.0,), {}, tps / 100)

    scenarios = [Scenario("a", "p", 16, 1, 32 * 1024, "wiki"), Scenario("b", "p", 16, 1, 8 * 1024, "wiki")]
    results = [
        result("a", "megatron", 100), result("a", "hotspa", 120), result("a", "hydraulis", 126),
        result("b", "megatron", 100), result("b", "megatron-dcp", 110), result("b", "hydraulis", 99),
    ]
    s = summarize(results, scenarios)
    assert s["best_other"]["a"] == {"policy": "hotspa", "speedup": pytest.approx(1.05)}
    assert s["best_other"]["b"] == {"policy": "megatron-dcp", "speedup": pytest.approx(0.9)}
    assert s["speedup_vs_best_other_min"] == pytest.approx(0.9)
    assert s["speedup_vs_best_other_geomean"] == pytest.approx((1.05 * 0.9) ** 0.5)
    assert s["speedup_vs_megatron_min_long"] == pytest.approx(1.26)  # only "a" reaches 16K
    lines = summary_lines({"summary": s})
    assert "hydraulis vs the best other policy on a: 1.050x (hotspa)" in lines
    # Every figure with a target says whether it met it.
    assert "hydraulis vs the best other policy, geometric mean: 0.972x (target >= 1.080x: NOT met)" in lines
    assert "hydraulis vs megatron, worst scenario with max length >= 16K: 1.26x (target >= 1.20x: met)" in lines
    assert "hydraulis balance efficiency, worst scenario: 0.800 (target >= 0.920: NOT met)" in lines


def test_bench_plot_labels_every_bar_and_keeps_its_legend_beside_the_bars(monkeypatch, tmp_path):
    import hydraulis.plots
    import hydraulis.report

    figures = []
    monkeypatch.setattr(hydraulis.report, "save_figure", lambda fig, path: figures.append(fig))
    policies = ["hydraulis", "megatron", "hotspa"]
    values = {"a": (1.27, 1.0, 1.19), "b": (1.5, 1.0, 1.3)}
    results = [{"scenario": sc, "policy": p, "speedup_vs_megatron": v}
               for sc, row in values.items() for p, v in zip(policies, row, strict=True)]
    report = {"scenarios": [{"name": "a"}, {"name": "b"}], "policies": policies, "results": results}
    hydraulis.report.bench_plot(report, tmp_path / "bench.png")
    (fig,) = figures
    ax = fig.axes[0]
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == sorted(["1.27", "1.00", "1.19", "1.50", "1.00", "1.30"])  # every bar says its value
    fig.canvas.draw()
    legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= axes.x1  # beside the axes: it hides no bar
    assert max(t.get_window_extent().y1 for t in ax.texts) <= axes.y1  # the labels fit inside
    assert "relative to megatron" in ax.get_title(loc="left")
    hydraulis.plots.pyplot().close(fig)


def test_timeline_legend_swatches_are_the_replicas_colours(monkeypatch, tmp_path):
    """Each replica's blocks are in its own colour (its y label too), and the legend's swatches are those
    colours, forward light and backward dark, not grey stand-ins."""
    import numpy as np
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Rectangle

    import hydraulis.report
    from hydraulis.cost import load_cost_model
    from hydraulis.planner.planner import Planner
    from hydraulis.planner.pool import parse_pool
    from hydraulis.planner.sim import simulate
    from hydraulis.specs import ClusterSpec

    cost = load_cost_model("tiny@cpu")
    (deployment,) = parse_pool("1x(tp2,pp1) + 1x(tp1,pp2)", ClusterSpec(4))
    plan = Planner(cost, 4, [deployment]).plan(np.array([200, 120, 90, 300, 60, 250]))
    figures = []
    monkeypatch.setattr(hydraulis.report, "save_figure", lambda fig, path: figures.append(fig))
    hydraulis.report.timeline_plot([("step 0", plan, simulate(plan, cost, keep_events=True))], tmp_path / "t.png")
    (fig,) = figures
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend()

    def rgba(patch):
        return tuple(round(x, 3) for x in patch.get_facecolor())

    drawn = {rgba(b) for b in ax.patches}  # two replicas x (forward, backward), and the gradient sync
    swatches = {rgba(r) for r in legend.findobj(Rectangle) if r is not legend.legendPatch}
    assert len(drawn) == 5 and swatches == drawn
    bars = [b for b in ax.patches if b.get_height() < 1]  # not the gradient sync's span
    by_row = {round(b.get_y() + b.get_height() / 2): to_rgb(b.get_facecolor()) for b in bars}
    assert [to_rgb(t.get_color()) for t in ax.get_yticklabels()] == [by_row[0], by_row[1]]  # rows 1, 2: tp1pp2
    assert by_row[1] == by_row[2] != by_row[0]
    hydraulis.report.pyplot().close(fig)


def test_baselines_get_full_recompute_only_where_nothing_fits_otherwise():
    from hydraulis.cost import load_cost_model
    from hydraulis.planner.policy import PolicyContext
    from hydraulis.planner.pool import fallback_config
    from hydraulis.specs import ClusterSpec

    cost, cluster = load_cost_model("llama-70b@h100-80g+cp"), ClusterSpec(64)
    batch = np.array([40000] + [3000, 800] * 20)
    assert max(cost.caps(64).values()) < 40000  # no config packs it plainly
    ctx = PolicyContext.build(cost, cluster, [batch])
    packed = ctx.recompute_where_needed(lone=False)
    assert packed.cost.name == "llama-70b@h100-80g+cp+recompute"
    config = fallback_config(packed.cost, cluster, 40000, [batch], lone=False)
    assert config in packed.cost.recompute and cost.cap(config, 64) < 40000 <= packed.cost.cap(config, 64)
    assert ctx.recompute_where_needed(lone=True) is ctx  # the planner holds it alone on a deep CP replica
    short = PolicyContext.build(cost, cluster, [batch[1:]])
    assert short.recompute_where_needed(lone=False) is short


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(longest=st.integers(27000, 90000))
def test_baselines_may_switch_on_the_lightest_uniform_policy_that_holds_the_longest(longest):
    """Each config that holds the run's longest sequence only under recompute runs the lightest policy that holds
    it for all its micro-batches (selective where it does); a config it already fits keeps its own."""
    from hydraulis.cost import load_cost_model
    from hydraulis.cost.policies import MemoryPolicy
    from hydraulis.planner.policy import PolicyContext
    from hydraulis.specs import ClusterSpec

    cost = load_cost_model("llama-70b@h100-80g+cp")
    ctx = PolicyContext.build(cost, ClusterSpec(64), [np.array([longest, 3000, 800])])
    light, full = (ctx.recompute_where_needed(lone=False, lightest=x).cost for x in (True, False))
    for g in (g for g in cost.configs if g.num_gpus <= 64):
        plain = cost.cap(g, 64) >= longest
        selective = cost.policy_cap(g, 64, MemoryPolicy.SELECTIVE) >= longest
        if plain or light is cost:
            assert light.policies(g) == cost.policies(g)
        elif selective:
            assert g in light.selective and light.cap(g, 64) >= longest and g in full.recompute
        elif g in full.recompute:
            assert g in light.recompute


def test_each_baseline_runs_at_least_as_fast_as_under_full_recompute():
    """The bench gives every baseline the faster of full recompute and the lightest uniform policy where the
    longest sequence needs one; hydraulis plans with a policy per micro-batch."""
    from hydraulis.bench import _run_policy, run_policies
    from hydraulis.cost import load_cost_model
    from hydraulis.planner.policy import PolicyContext
    from hydraulis.specs import ClusterSpec

    cost = load_cost_model("llama-70b@h100-80g+cp")
    batch = np.array([40000] + [3000, 800] * 20)
    ctx = PolicyContext.build(cost, ClusterSpec(64), [batch])
    names = ["megatron", "flops-balanced", "hotspa"]
    results = {r.policy: r for r in run_policies("t", ctx, [batch], [*names, "hydraulis"], memory_policies=True)}
    full = ctx.recompute_where_needed(lone=False)
    for name in names:
        assert results[name].iteration_times_s[0] <= sum(_run_policy(name, full, [batch])[1]) * (1 + 1e-9)
    assert results["hydraulis"].tokens_per_s >= max(results[n].tokens_per_s for n in names)


def test_bench_lists_a_group_and_refuses_an_unknown_one(cli, tmp_path):
    res = cli("bench", "--group", "long", "--list")
    assert res.returncode == 0, res.stderr
    assert "long-13b-64g-stdlib-1m-256k" in res.stdout and "7b-16g-wiki-256k-8k" not in res.stdout
    bad = cli("bench", "--group", "huge", "--out", str(tmp_path / "out"))
    assert bad.returncode == 2 and "unknown scenario group 'huge'" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("interleave", [False, True])
def test_baselines_interleave_as_the_recipes_do_and_report_their_plain_figure(interleave):
    """With interleaving, megatron and hotspa run the recipes' vp above PP 2 where it is faster, and report their
    plain-1F1B tokens/s beside it; with it off (`bench --vp1`) no schedule holds a vp and nothing is reported."""
    from hydraulis.baselines.homogeneous import recipe_interleaving
    from hydraulis.bench import run_policies
    from hydraulis.cost import load_cost_model
    from hydraulis.parallel import ParallelConfig
    from hydraulis.planner.policy import PolicyContext
    from hydraulis.specs import ClusterSpec

    cost = load_cost_model("llama-70b@h100-80g+cp")
    batch = np.array([16000] + [3000, 800] * 20)
    ctx = dataclasses.replace(PolicyContext.build(cost, ClusterSpec(64), [batch]), interleave=interleave)
    seen: set[int] = set()
    keep = lambda policy, step, schedule: seen.update(r.config.vp for p in schedule.phases  # noqa: E731
                                                      for r in p.deployment.replicas)
    results = run_policies("t", ctx, [batch], ["megatron", "hotspa"], keep=keep)
    for r in results:
        if interleave:
            assert r.tokens_per_s_vp1 is not None and r.tokens_per_s >= r.tokens_per_s_vp1 * (1 - 1e-12)
        else:
            assert r.tokens_per_s_vp1 is None
    assert (max(seen) > 1) == interleave  # hotspa runs tp?pp8 interleaved on some range
    deep = ParallelConfig(4, 8)
    assert recipe_interleaving(ctx, deep, 1024) == (deep.interleaved(5) if interleave else deep)
    assert recipe_interleaving(ctx, ParallelConfig(4, 2), 1024) == ParallelConfig(4, 2)  # PP 2: none
