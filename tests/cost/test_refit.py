"""Online refit: configs whose predictions stay more than 15% off are rescaled from the run's measurements."""

from __future__ import annotations

import copy
import json
from importlib import resources

import pytest

from hydraulis.cost import ProfiledCostModel
from hydraulis.cost.conditions import Conditions
from hydraulis.cost.refit import REFIT_STEPS, OnlineRefit, refit_profile
from hydraulis.parallel import ParallelConfig

TP1, TP2 = ParallelConfig(1, 1), ParallelConfig(2, 1)


def _profile() -> dict:
    path = resources.files("hydraulis.cost") / "profiles" / "tiny-cpu-measured.json"
    return copy.deepcopy(json.loads(path.read_text()))


def test_a_profile_scaled_by_one_and_a_half_is_refit_to_what_ran():
    cost = ProfiledCostModel.from_dict(_profile()).with_recompute([TP2])
    refit = OnlineRefit(cost)
    done = None
    for step in range(REFIT_STEPS):
        assert done is None
        # tp1 replicas ran 1/1.5 of their prediction (about 1.49 and 1.51 over the replicas); tp2 as predicted
        done = refit.observe(step, [TP2, TP1, TP1], [1.0, 1.0, 1.0], [1.02, 1.49, 1.51])
    assert done is not None and set(done.scales) == {TP1}
    assert done.scales[TP1] == pytest.approx(1 / 1.5, rel=1e-3)
    old, new = cost.coefficients(TP1), done.cost.coefficients(TP1)
    assert (new.a, new.b, new.c) == pytest.approx((old.a / 1.5, old.b / 1.5, old.c / 1.5), rel=1e-3)
    assert done.cost.coefficients(TP2) == cost.coefficients(TP2)  # within 15%: left alone
    assert done.cost.recompute == cost.recompute and done.cost.cap(TP2, 4) == cost.cap(TP2, 4)
    assert "refit after step 4: tp1pp1 x0.67" in done.line()
    # The history starts again: the refit model gets a whole window before another refit.
    assert refit.observe(5, [TP1], [1.0], [1.5]) is None


def test_one_disturbed_step_among_the_window_does_not_restart_the_count():
    refit = OnlineRefit(ProfiledCostModel.from_dict(_profile()))
    # over-predicted by about 20% (2 ranks' noise), one step in the middle ran slow: still a wrong level
    ratios = [1 / 1.2, 1 / 1.25, 1.3, 1 / 1.18, 1 / 1.22]
    done = [refit.observe(step, [TP1], [r], [1.0]) for step, r in enumerate(ratios)]
    assert done[:-1] == [None] * (REFIT_STEPS - 1) and done[-1] is not None
    assert done[-1].scales[TP1] == pytest.approx(1 / 1.2)  # the median ratio: the outlier moves nothing
    assert "off in 4 of 5 steps" in done[-1].line()


def test_errors_on_both_sides_or_within_15_percent_refit_nothing():
    refit = OnlineRefit(ProfiledCostModel.from_dict(_profile()))
    for step in range(3 * REFIT_STEPS):
        off = 1.5 if step % 2 else 0.6  # off each step, but not on one side: noise, not a wrong model
        assert refit.observe(step, [TP1, TP2], [1.0, 1.0], [off, 1.1]) is None
    # An idle replica (no micro-batches: nothing predicted) is no evidence either way.
    assert all(refit.observe(s, [TP1], [0.01], [0.0]) is None for s in range(REFIT_STEPS))


def test_the_refit_profile_is_the_profile_scaled_and_marked():
    data = _profile()
    run = Conditions(4, 1, 2, 0.0)
    out = refit_profile(data, {TP1: 0.5}, "runs/x", 7, run)
    row = next(r for r in out["time_ms"] if (r["tp"], r["pp"]) == (1, 1))
    before = next(r for r in data["time_ms"] if (r["tp"], r["pp"]) == (1, 1))
    assert row["a"] == before["a"] / 2 and row["c"] == before["c"] / 2
    assert out["refit"] == {"source": "runs/x", "step": 7, "scales": {"tp1pp1": 0.5}}
    assert out["conditions"] == run.to_json() and out["name"].endswith("(refit)")
    cost = ProfiledCostModel.from_dict(out)  # still a profile
    assert cost.coefficients(TP1).b == pytest.approx(ProfiledCostModel.from_dict(data).coefficients(TP1).b / 2)
