"""The 1F1B estimate exists three times for speed: replicas.estimate_time (vectorised),
dispatch._scalar_estimate (the greedy's pp > 1 path) and the greedy's inlined pp = 1 branch.
They must agree."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.parallel import Deployment
from hydraulis.planner import dispatch
from hydraulis.planner.dispatch import _scalar_estimate, greedy_dispatch
from hydraulis.planner.replicas import ReplicaTable, estimate_time
from hydraulis.specs import ClusterSpec

COST = load_cost_model("llama-7b@a800-80g")
CLUSTER = ClusterSpec(16)
DEPLOYMENTS = (
    "8x(tp2,pp1)",
    "1x(tp8,pp1) + 4x(tp2,pp1)",
    "4x(tp2,pp2)",
    "2x(tp4,pp1) + 2x(tp1,pp4)",
    "1x(tp4,pp2) + 2x(tp2,pp2)",
)


@settings(max_examples=300, deadline=None)
@given(
    W=st.floats(1e-4, 1e3),
    T=st.integers(1, 10**6),
    n=st.integers(1, 5000),
    wmax_share=st.floats(0.0, 1.0),
    c=st.one_of(st.just(0.0), st.floats(1e-4, 1.0)),
    pp=st.integers(1, 16),
    cap=st.integers(128, 200_000),
    me=st.integers(0, 4096),
)
def test_scalar_and_vectorised_estimates_agree(W, T, n, wmax_share, c, pp, cap, me):
    wmax = W * wmax_share
    vector = float(estimate_time(W, T, n, wmax, c, pp, cap, me))
    scalar = _scalar_estimate(W, T, n, wmax, c, pp - 1, cap, me)
    assert math.isfinite(scalar)
    assert scalar == pytest.approx(vector, rel=1e-12)
    if pp == 1:  # the greedy's inlined branch: W + c * ceil(T / cap)
        assert W + c * max(1, -(-T // cap)) == pytest.approx(vector, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 16), st.booleans())
def test_the_estimate_over_arrays_is_the_scalar_one_to_the_last_bit(seed, pp, lone):
    """`estimate_time` on arrays (in place, as the local search's swaps call it on a few hundred thousand
    pairs) and `_scalar_estimate` (the greedy's) compute the same float operations: equal, not close."""
    rng = np.random.default_rng(seed)
    shape = (7, 9)
    W = rng.random(shape) * 10.0 ** rng.uniform(-3, 3)
    T = rng.integers(1, 10**6, shape)
    n = rng.integers(0, 50, (7, 1))
    wmax = W * rng.random(shape)
    c, cap, me = float(rng.choice([0.0, 1e-3, 0.05])), int(rng.integers(128, 200_000)), int(rng.integers(0, 4096))
    extra = (int(rng.integers(1, 10**6)), float(np.quantile(wmax, 0.7))) if lone else ()
    vector = estimate_time(W, T, n, wmax, c, pp, cap, me, *extra)
    scalar = [[_scalar_estimate(float(W[i, j]), int(T[i, j]), int(n[i, 0]), float(wmax[i, j]), c, pp - 1, cap, me,
                                *extra) for j in range(shape[1])] for i in range(shape[0])]
    assert vector.tolist() == scalar


def slow_greedy(lengths: np.ndarray, table: ReplicaTable, bias: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """greedy_dispatch with every estimate from the vectorised estimate_time: (replica per sequence,
    the chosen replica's estimate at each step)."""
    keys = []
    w = table.cost_matrix(lengths)
    heaps: list[list[tuple[float, int]]] = [[] for _ in table.configs]
    for r in range(len(table)):
        heaps[int(table.group[r])].append((float(bias[r]), r))
    for h in heaps:
        heapq.heapify(h)
    R = len(table)
    W, T, n, wmax = np.zeros(R), np.zeros(R, dtype=np.int64), np.zeros(R, dtype=np.int64), np.zeros(R)
    out = np.zeros(len(lengths), dtype=np.int64)
    for i in np.argsort(-lengths, kind="stable").tolist():
        s = int(lengths[i])
        best, best_g, best_r = math.inf, -1, -1
        for g, m in enumerate(table.configs):
            if m.holds < s:
                continue
            wi = float(w[g, i])

            def est(r: int, wi: float = wi, s: int = s) -> float:
                p = [x[r] for x in table.params]  # with the lone cap: a sequence beyond the cap runs alone
                return float(estimate_time(W[r] + wi, T[r] + s, n[r] + 1, max(wmax[r], wi), *p)) + float(bias[r])

            # The least loaded replica of the config, or, where it has no room, the best of the others.
            e, r = est(heaps[g][0][1]), heaps[g][0][1]
            if e == math.inf:
                e, r = min((est(q), q) for _, q in heaps[g])
            if e < best:
                best, best_g, best_r = e, g, r
        wi = float(w[best_g, i])
        W[best_r] += wi
        T[best_r] += s
        n[best_r] += 1
        wmax[best_r] = max(wmax[best_r], wi)
        heap = heaps[best_g]
        heap[[q for _, q in heap].index(best_r)] = (best, best_r)
        heapq.heapify(heap)
        keys.append(best)
        out[i] = best_r
    return out, keys


@settings(max_examples=40, deadline=None)
@given(
    which=st.sampled_from(DEPLOYMENTS),
    n=st.integers(1, 150),
    scale=st.sampled_from([300, 3000, 12000]),
    biased=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_greedy_dispatch_estimates_as_estimate_time_does(which, n, scale, biased, seed):
    """Both the inlined pp = 1 branch and the scalar pp > 1 path estimate, and so choose, as estimate_time.

    Batches from a few hundred to over a million tokens: replicas run from one micro-batch to many, and a
    sequence beyond a config's cap but within its lone cap runs alone on one of its replicas."""
    rng = np.random.default_rng(seed)
    table = ReplicaTable.of(COST, Deployment.parse(which, CLUSTER), 16)
    lengths = np.minimum(rng.integers(1, 2 * scale, n), int(table.cap.max()))
    bias = rng.uniform(0, 0.5, len(table)) if biased else np.zeros(len(table))
    keys: list[float] = []

    class Recorder:  # the greedy keys its heaps by the estimate of the replica it just chose
        heapify = staticmethod(heapq.heapify)

        @staticmethod
        def heapreplace(heap, item):
            keys.append(item[0])
            return heapq.heapreplace(heap, item)

        @staticmethod
        def heappush(heap, item):  # the chosen replica was not its config's least loaded (a lone micro-batch)
            keys.append(item[0])
            return heapq.heappush(heap, item)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "heapq", Recorder)
        fast = greedy_dispatch(lengths, table, bias)
    slow, slow_keys = slow_greedy(lengths, table, bias)
    assert np.array_equal(fast, slow)
    assert keys == pytest.approx(slow_keys, rel=1e-12)
