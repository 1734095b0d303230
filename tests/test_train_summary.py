"""The run summary's and report's fidelity figures: predicted against measured iteration time."""

from __future__ import annotations

import pytest
from train_helpers import metric_rows

from hydraulis.report import iteration_errors
from hydraulis.report import training_plot as report_plot
from hydraulis.training.run_log import summarize


def _row(step: int, predicted: float, measured: float) -> dict:
    return {
        "step": step, "loss": 5.0 - step, "tokens": 1000, "tokens_per_s": 1000 / measured, "deployment": "4x(tp1,pp1)",
        "switched": False, "switch_s": 0.0, "planning_s": 0.01, "planning_unhidden_s": 0.0,
        "iteration_s": measured, "predicted_s": predicted, "replica_s": [measured, 0.0],
        "replica_predicted_s": [predicted, 0.0], "lr": 1e-3 * (step + 1),
    }


def test_summary_carries_the_median_and_worst_absolute_relative_iteration_error():
    rows = [_row(0, 1.0, 1.0), _row(1, 1.2, 1.0), _row(2, 0.5, 1.0), _row(3, 2.2, 2.0)]
    assert iteration_errors(rows) == pytest.approx([0.0, 0.2, 0.5, 0.1])
    summary = summarize(rows)
    assert summary["iteration_error_median"] == pytest.approx(0.15)
    assert summary["iteration_error_max"] == pytest.approx(0.5)


def test_report_plots_the_fidelity_panel(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "report.png"
    report_plot([_row(0, 1.0, 1.1), _row(1, 0.8, 0.7)], path, "test")
    assert path.stat().st_size > 10_000


def test_the_memory_panel_plots_predicted_every_step_and_measured_where_measured(tmp_path):
    """CPU runs sample memory: unmeasured steps (peak 0) are not drawn as a zero measurement."""
    pytest.importorskip("matplotlib")
    from hydraulis.plots import pyplot
    from hydraulis.report import memory_panel

    mib = 2**20
    # null: not measured; 0: not measured, as runs before 2026-12-05 wrote it
    rows = [{**_row(k, 1.0, 1.0), "memory_predicted_bytes": 100 * mib, "memory_peak_bytes": peak and peak * mib,
             "exchange_peak_bytes": peak and 8 * mib, "memory_error": peak and abs(peak - 100) / 100}
            for k, peak in enumerate([95, None, 0, 110])]  # fmt: skip
    fig, ax = pyplot().subplots()
    memory_panel(ax, rows)
    assert list(ax.lines[0].get_ydata()) == [100.0] * 4
    measured, exchange = ax.collections
    assert measured.get_offsets().tolist() == [[0, 95.0], [3, 110.0]]
    assert exchange.get_offsets().tolist() == [[0, 8.0], [3, 8.0]]
    assert "worst error 10%" in ax.get_title()
    summary = summarize(rows)  # over the measured steps; None where none was measured
    assert (summary["memory_peak_bytes"], summary["exchange_peak_bytes"]) == (110 * mib, 8 * mib)
    assert summary["memory_error_max"] == pytest.approx(0.1)
    unmeasured = summarize([{**r, "memory_peak_bytes": None, "exchange_peak_bytes": None, "memory_error": None}
                            for r in rows])  # fmt: skip
    assert [unmeasured[k] for k in ("memory_peak_bytes", "memory_predicted_bytes", "memory_error_max")] == [None] * 3
    fig, ax = pyplot().subplots()
    memory_panel(ax, rows, 120 * mib)  # a budget above every peak: still drawn, inside the panel
    (budget,) = [line for line in ax.lines if "budget" in line.get_label()]
    assert list(budget.get_ydata()) == [120.0, 120.0] and ax.get_ylim()[1] > 120
    report_plot(rows, tmp_path / "report.png", "with memory")
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_the_report_has_an_lr_panel_whole_steps_and_the_title_it_is_given(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import hydraulis.report

    figures = []
    monkeypatch.setattr(hydraulis.report, "save_figure", lambda fig, path: figures.append(fig))
    rows = [_row(k, 1.0, 1.1) for k in range(3)]
    report_plot(rows, tmp_path / "report.png", "run runs/x: tiny", budget_bytes=64 << 20)
    (fig,) = figures
    fig.canvas.draw()
    assert fig._suptitle.get_text() == "run runs/x: tiny"
    (lr,) = [ax for ax in fig.axes if ax.get_title() == "learning rate"]
    assert list(lr.lines[0].get_ydata()) == [1e-3, 2e-3, 3e-3]
    for ax in fig.axes:
        if ax.get_xlabel() == "step":  # no 0.5 steps on a 3-step run
            assert all(float(t).is_integer() for t in ax.get_xticks()), (ax.get_title(), ax.get_xticks())
    hydraulis.report.pyplot().close(fig)


def test_a_cached_auto_profile_without_a_cp_config_of_the_pool_is_measured_again():
    """A profile with tp1pp1 only does not describe a pool with tp1pp1cp2: the cp row is missing."""
    from dataclasses import asdict

    from hydraulis.cost.sweep import ProfileSettings
    from hydraulis.parallel import ParallelConfig
    from hydraulis.specs import get_model
    from hydraulis.training.auto_profile import AutoProfile

    spec, settings = get_model("tiny"), ProfileSettings()
    request = AutoProfile(spec, (ParallelConfig(1, 1), ParallelConfig(1, 1, 2)), 4, "cpu", settings)
    data = {
        "model": asdict(spec),
        "device": {"kind": "cpu", "dtype": "fp32"},
        "measurements": {"world_size": 4, "settings": settings.to_json()},
        "time_ms": [{"tp": 1, "pp": 1}],
    }
    assert request.mismatch(data) == "it lacks tp1pp1cp2"
    data["time_ms"].append({"tp": 1, "pp": 1, "cp": 2})
    assert request.mismatch(data) is None


def test_a_profile_measured_under_load_is_never_reused_from_the_cache_but_is_the_run_directorys_own(tmp_path):
    """A profile in the shared cache that other processes' load disturbed (one kept before the cache refused
    them) is measured again, with the reason in one line: it would carry that hour's load into every later
    run. The same file as a run directory's own (a resume) is used: that run planned with it."""
    import json
    from dataclasses import asdict

    from hydraulis.cost.sweep import ProfileSettings
    from hydraulis.parallel import ParallelConfig
    from hydraulis.specs import get_model
    from hydraulis.training.auto_profile import AutoProfile, start_lines

    spec, settings = get_model("tiny"), ProfileSettings()
    request = AutoProfile(spec, (ParallelConfig(1, 1),), 4, "cpu", settings)
    load = {"foreign_cores_median": 0.99, "foreign_cores_max": 1.27, "measured_again": 7, "disturbed_kept": 15}
    data = {"model": asdict(spec), "device": {"kind": "cpu", "dtype": "fp32"}, "conditions": {"cores": 2},
            "measurements": {"world_size": 4, "settings": settings.to_json(), "load": load},
            "time_ms": [{"tp": 1, "pp": 1}]}
    path = tmp_path / "profile.json"
    for foreign, busy in ((0.99, True), (0.1, False)):  # over and under a tenth of the 2 cores
        data["measurements"]["load"]["foreign_cores_median"] = foreign
        path.write_text(json.dumps(data))
        lines: list[str] = []
        assert request.cached(path, lines.append) == (None if busy else data)
        refused = f"measured while other processes took a median {foreign:.2f} (at most 1.27) of 2 cores: the cache"
        assert any(refused in line for line in lines) == busy, lines
        assert request.cached(path, lines.append, shared=False) == data
        said = start_lines(data, "here")[0]
        assert said == f"profile: here, measured at a time it does not record, {'under load' if busy else 'quiet'}: " \
            f"other processes took a median {foreign:.2f} (at most 1.27) of 2 cores"


def test_steps_over_the_memory_budget_are_marked_counted_and_warned_once(tmp_path, capsys, monkeypatch):
    """[parallel] memory_per_rank: each step whose measured peak exceeded it is marked in metrics.jsonl,
    summary.json counts them beside the budget, and the terminal gets one warning line for the run."""
    import json

    pytest.importorskip("torch")
    from hydraulis.cost import load_cost_model
    from hydraulis.data.sampler import TokenBudgetSampler
    from hydraulis.optim import OptimSettings
    from hydraulis.planner.pool import parse_pool
    from hydraulis.runtime.trainer import StepMetrics
    from hydraulis.specs import ClusterSpec, get_model
    from hydraulis.training.config import parse_config, toml_text
    from hydraulis.training.job import trainer_settings
    from hydraulis.training.job_config import ParallelChoice, train_settings
    from hydraulis.training.job_cost import for_job
    from hydraulis.training.run_log import RunLog
    from hydraulis.training.settings import DataSettings, Invocation, RunSettings

    values = parse_config({"parallel": {"pool": "4x(tp1,pp1)", "memory_per_rank": "40MiB"},
                           "train": {"steps": 3}}).resolved_values()
    parallel = ParallelChoice.of(values["parallel"])
    pool = parse_pool("4x(tp1,pp1)", ClusterSpec(4))
    cost = for_job(load_cost_model("tiny@cpu-measured"), parallel, "fp32")  # the budget in it, as a job's
    job = RunSettings(
        trainer=trainer_settings(get_model("tiny"), tuple(pool), cost, parallel=parallel, optim=OptimSettings(),
                                 train=train_settings(values)),
        data=DataSettings(corpus_path="", tokenizer="bytes", sampler=TokenBudgetSampler([4], 16, 8), max_len=8),
        invocation=Invocation(out=str(tmp_path)), world=4, config_toml=toml_text(values),
    )
    log = RunLog(job)
    for step, peak in enumerate((30 << 20, 45 << 20, 41 << 20)):
        log.step(StepMetrics(step, 5.0, 100, 2, "4x(tp1,pp1)", 0, False, 0.1, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 1e-3,
                             1.0, (0.1,) * 4, (0.1,) * 4, (1,) * 4, 0, 0, memory_peak_bytes=peak,
                             memory_predicted_bytes=35 << 20, memory_over_budget=peak > 40 << 20))
    log.close()
    import hydraulis.training.run_log

    drawn = []
    monkeypatch.setattr(hydraulis.training.run_log, "training_plot", lambda *args: drawn.append(args))
    summary = log.finish()
    (_, path, title, budget), = drawn  # report.png: the run named, the budget drawn where memory is
    assert path == tmp_path / "report.png" and budget == 40 << 20
    assert title.startswith(f"run {tmp_path}: tiny (") and "pool 4x(tp1,pp1)" in title
    rows = metric_rows(tmp_path)
    assert [r.get("memory_over_budget") for r in rows[:3]] == [False, True, True]
    assert summary["steps_over_budget"] == 2 and summary["memory_budget_bytes"] == 40 << 20
    assert json.loads((tmp_path / "summary.json").read_text())["steps_over_budget"] == 2
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")]
    assert warnings == ["warning: step 1: a rank peaked at 45.0 MiB, over parallel.memory_per_rank 40MiB "
                        "(40.0 MiB; predicted 35.0 MiB)"]


def test_a_step_on_one_deployment_in_consecutive_phases_says_why(tmp_path, capsys, monkeypatch):
    """The planner's schedule of a batch whose 14,810 and 14,485 tokens fit 2x(tp8,pp1) only as its replicas'
    only micro-batches (tests/planner/test_phases.py): the step's line names the two phases on it once, with the
    memory as the reason, metrics.jsonl counts those micro-batches, summary.json and the closing line the step."""
    pytest.importorskip("torch")
    import numpy as np

    import hydraulis.training.run_log
    from hydraulis.cost import load_cost_model
    from hydraulis.data.sampler import TokenBudgetSampler
    from hydraulis.optim import OptimSettings
    from hydraulis.parallel import Deployment
    from hydraulis.planner.phases import PhasedPlanner
    from hydraulis.planner.schedule import MemoryChoices
    from hydraulis.runtime.trainer import StepMetrics
    from hydraulis.specs import ClusterSpec, get_model
    from hydraulis.training.config import parse_config, toml_text
    from hydraulis.training.job import trainer_settings
    from hydraulis.training.job_config import ParallelChoice, train_settings
    from hydraulis.training.run_log import RunLog
    from hydraulis.training.settings import DataSettings, Invocation, RunSettings

    cost, cluster = load_cost_model("llama-32b@a800-80g"), ClusterSpec(16)
    pool = tuple(Deployment.parse(t, cluster) for t in ("1x(tp16,pp1)", "2x(tp8,pp1)", "1x(tp8,pp2)"))
    rng = np.random.default_rng(6)
    b = np.concatenate([[int(rng.integers(12000, 24576))] * int(rng.integers(1, 5)),
                        np.minimum(rng.lognormal(7.8, 1.0, 40).astype(np.int64) + 64, 20000)])
    schedule = PhasedPlanner(cost, 16, list(pool)).schedule(b)
    choices = MemoryChoices.of(schedule, cost, 16)
    assert choices.alone == 2 and choices.totals == {"none": sum(len(r.micro_batches) for p in schedule.phases
                                                                 for r in p.replicas)}
    values = parse_config({"parallel": {"pool": "; ".join(map(str, pool))},
                           "train": {"log_every": 1, "steps": 1}}).resolved_values()
    job = RunSettings(
        trainer=trainer_settings(get_model("tiny"), pool, cost, parallel=ParallelChoice.of(values["parallel"]),
                                 optim=OptimSettings(), train=train_settings(values)),
        data=DataSettings(corpus_path="", tokenizer="bytes", sampler=TokenBudgetSampler([4], 16, 8), max_len=8),
        invocation=Invocation(out=str(tmp_path)), world=16, config_toml=toml_text(values),
    )
    log = RunLog(job)
    replicas = sum(len(p.replicas) for p in schedule.phases)
    log.step(StepMetrics(0, 5.0, int(b.sum()), len(b), " | ".join(str(p.deployment) for p in schedule.phases), 2,
                         False, 20.0, schedule.iteration_time_s, 0.0, 0.0, 0.0, 0.0, 0.0, 1e-3, 1.0, (1.0,) * replicas,
                         (1.0,) * replicas, tuple(len(r.micro_batches) for p in schedule.phases for r in p.replicas),
                         0, 0, phases=3, memory_choices=choices))
    log.close()
    monkeypatch.setattr(hydraulis.training.run_log, "training_plot", lambda *args: None)
    summary = log.finish()
    out = capsys.readouterr().out
    assert ("2 phases of 2x(tp8,pp1), then 1x(tp16,pp1) (memory: 2 micro-batch(es) fit only as their replica's "
            "only one)") in out
    assert metric_rows(tmp_path)[0]["memory_choices"] == {"policies": {"none": list(choices.policies[0][1])},
                                                          "alone": 2}
    assert summary["memory_choices"]["steps_repeated_phases"] == 1 and summary["memory_choices"]["alone"] == 2
    assert "memory: 1 step(s) ran one deployment in several phases; 2 micro-batch(es) fit only as their replica's " \
        "only one" in out
