"""Large batches: bulk placement of light sequences keeps plans valid and as good as one-by-one placement."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.errors import HydraulisError
from hydraulis.limits import check_lengths
from hydraulis.planner import dispatch, packing, planner
from hydraulis.planner.dispatch import _level_counts
from hydraulis.planner.packing import first_fit_decreasing, first_fit_without_shortest
from hydraulis.planner.planner import Planner
from hydraulis.planner.pool import parse_pool
from hydraulis.specs import ClusterSpec

COST = load_cost_model("llama-7b@a800-80g")


def sft_batch(n: int, seed: int = 0, long: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.integers(50, 401, n), rng.integers(8000, 30000, long)])


def one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn the bulk paths off: every sequence placed and packed one at a time, as for small batches."""
    monkeypatch.setattr(dispatch, "BULK_MIN_SEQUENCES", 10**9)
    monkeypatch.setattr(planner, "BULK_MIN_SEQUENCES", 10**9)
    monkeypatch.setattr(packing, "BULK_PACK_ITEMS", 10**9)


@pytest.mark.parametrize("pool", ["8x(tp2,pp1)", "4x(tp1,pp4)", "1x(tp8,pp1) + 4x(tp2,pp1)"])
def test_bulk_plans_are_valid_and_as_fast_as_one_by_one(monkeypatch, pool):
    gpus = 16
    deployments = parse_pool(pool, ClusterSpec(gpus))
    batch = sft_batch(20_000, long=6 if "tp8" in pool else 0)
    bulk = Planner(COST, gpus, deployments).plan(batch)  # finalize validates: each sequence once, caps hold
    bulk.validate(COST, gpus)
    assert sorted(bulk.lengths) == sorted(batch.tolist())
    one_by_one(monkeypatch)
    exact = Planner(COST, gpus, deployments).plan(batch)
    assert bulk.predicted_time_s <= exact.predicted_time_s * 1.005


def test_a_run_only_goes_where_its_cap_holds():
    # 23K tokens fit the tp8 replica only (tp2's cap is 17280 on 16 GPUs). With 200 of them each is light
    # enough to go in bulk, and runs of them must still go to tp8 alone.
    deployments = parse_pool("1x(tp8,pp1) + 4x(tp2,pp1)", ClusterSpec(16))
    batch = np.concatenate([np.full(200, 23_000), np.full(12_000, 300), np.full(12_000, 20)])
    plan = Planner(COST, 16, deployments).plan(batch)
    plan.validate(COST, 16)
    big = {i for i, s in enumerate(plan.lengths) if s == 23_000}
    assert {i for mb in plan.replicas[0].micro_batches for i in mb} >= big
    assert all(len(r.micro_batches) for r in plan.replicas)  # the light tail reached every replica


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0, 100), min_size=1, max_size=30),
    st.lists(st.floats(0.01, 10), min_size=30, max_size=30),
    st.integers(0, 5000),
)
def test_level_counts_place_the_whole_run(e0, slope, m):
    e0 = np.array(e0)
    slope = np.array(slope[: len(e0)])
    k = _level_counts(e0, slope, m)
    assert k.sum() == m and (k >= 0).all()
    level = e0 + k * slope
    # Nobody who got sequences ends more than one sequence above anyone else's final level.
    if m:
        assert level[k > 0].max() <= level.min() + slope.max() + 1e-9


def _ffd_one_by_one(lengths: np.ndarray, cap: int) -> list[list[int]]:
    rooms: list[int] = []
    bins: list[list[int]] = []
    for k in np.argsort(-lengths, kind="stable").tolist():
        s = int(lengths[k])
        for j, room in enumerate(rooms):
            if room >= s:
                rooms[j] -= s
                bins[j].append(k)
                break
        else:
            rooms.append(cap - s)
            bins.append([k])
    return bins


@settings(max_examples=300, deadline=None)
@given(st.integers(4, 120), st.data())
def test_ffd_in_runs_equals_ffd_one_by_one(cap, data):
    values = st.sampled_from([1, 2, 3, cap // 2, cap // 2 + 1, cap]) | st.integers(1, cap)
    lengths = np.array(data.draw(st.lists(values, min_size=1, max_size=1500)))
    assert first_fit_decreasing(lengths, cap) == _ffd_one_by_one(lengths, cap)


@settings(max_examples=200, deadline=None)
@given(st.integers(4, 120), st.data())
def test_ffd_without_the_shortest_in_one_pass_equals_ffd_of_the_rest(cap, data):
    """`first_fit_without_shortest` (ramp_bins's one pass) is FFD one by one of the batch without its k
    shortest (a stable ascending sort's first k: ties at the cut drop their first positions)."""
    values = st.sampled_from([1, 2, 3, cap // 2, cap // 2 + 1, cap]) | st.integers(1, cap)
    lengths = np.array(data.draw(st.lists(values, min_size=1, max_size=400)))
    drops = data.draw(st.lists(st.integers(0, len(lengths)), max_size=5))
    order = np.argsort(lengths, kind="stable")
    for k, bins in zip(drops, first_fit_without_shortest(lengths, cap, drops), strict=True):
        rest = order[k:]
        assert bins == [rest[b].tolist() for b in _ffd_one_by_one(lengths[rest], cap)]


def test_lengths_from_2_31_are_refused():
    with pytest.raises(HydraulisError, match="below 2\\^31"):
        check_lengths([5, 2**31])
