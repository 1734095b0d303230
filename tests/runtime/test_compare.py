"""The measured comparison's arithmetic (runtime/metering/compare.py): per batch the median over repeats, and switches
charged as each variant's own sequence pays them, not as the batch-by-batch interleaving made them."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from hydraulis.runtime.metering.compare import Comparison, charged  # noqa: E402


def test_one_disturbed_repeat_of_a_batch_moves_nothing_where_medians_of_totals_lose_it():
    # 4 batches, 3 repeats; planned 1.0 s a batch, the homogeneous deployment 1.4 s: 1.4x. A busy process took
    # the cores while the planned run's batches 1-3 of repeat 0 ran (2.5x slower), and for batch 0 of repeat 1
    # on both variants: each batch has one disturbed repeat at most.
    planned = [[1.0, 2.5, 2.5, 2.5], [2.5, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    homogeneous = [[1.4, 1.4, 1.4, 1.4], [3.5, 1.4, 1.4, 1.4], [1.4, 1.4, 1.4, 1.4]]
    c = Comparison(4096, 3, {"planned": planned, "2x(tp2,pp1)": homogeneous}, {"planned": 4.0, "2x(tp2,pp1)": 5.6})
    out = c.to_dict()
    assert out["measured_speedup"] == pytest.approx(1.4)  # per batch, the median repeat is a quiet one
    assert out["median_s"] == {"planned": pytest.approx(4.0), "2x(tp2,pp1)": pytest.approx(5.6)}
    assert out["measured_speedup_per_repeat"] == pytest.approx([5.6 / 8.5, 7.7 / 5.5, 1.4])
    # The median of per-repeat totals (block after block's measure): 5.6 / 5.5, the 1.4x all but gone.
    totals = out["measured_s"]
    assert sorted(totals["2x(tp2,pp1)"])[1] / sorted(totals["planned"])[1] == pytest.approx(5.6 / 5.5)


def test_switches_are_charged_as_each_variant_would_have_paid_them():
    # Interleaved, every iteration followed another variant's deployment, so each one switched (0.1 s), except
    # where the planned run's previous variant happened to run the same deployment (None: no switch).
    rows = {"planned": [[(1.1, 0.1), (1.1, 0.1), (1.0, None)]], "homogeneous": [[(1.5, 0.1), (1.5, 0.1), (1.5, 0.1)]]}
    # On its own the planned run switches before batch 1 and batch 2; the homogeneous run never.
    own = {"planned": [False, True, True], "homogeneous": [False, False, False]}
    out = charged(rows, own)
    assert out["planned"] == [pytest.approx([1.0, 1.1, 1.1])]  # batch 2's switch charged at the median 0.1 s
    assert out["homogeneous"] == [pytest.approx([1.4, 1.4, 1.4])]


def test_the_ranks_cpu_time_is_compared_as_the_wall_time_is():
    # Wall time 1.0 s against 1.2 s a batch; CPU time (4 ranks) 3.0 s against 4.5 s, one repeat disturbed.
    wall = {"planned": [[1.0, 1.0]] * 3, "2x(tp2,pp1)": [[1.2, 1.2]] * 3}
    cpu = {"planned": [[3.0, 3.0], [3.0, 9.0], [3.0, 3.0]], "2x(tp2,pp1)": [[4.5, 4.5]] * 3}
    out = Comparison(100, 3, wall, {"planned": 2.0, "2x(tp2,pp1)": 2.4}, cpu).to_dict()
    assert out["measured_speedup"] == pytest.approx(1.2) and out["cpu_speedup"] == pytest.approx(1.5)
    assert out["cpu_s"] == {"planned": pytest.approx(6.0), "2x(tp2,pp1)": pytest.approx(9.0)}
    assert "cpu_speedup" not in Comparison(100, 3, wall, {"planned": 2.0, "2x(tp2,pp1)": 2.4}).to_dict()
