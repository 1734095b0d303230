"""The 1F1B estimate exists three times for speed: replicas.estimate_time (vectorised),
dispatch._scalar_estimate (the greedy's pp > 1 path) and the greedy's inlined pp = 1 branch.
They must agree. The local search's swap step estimates only the pairs that can pay: it must end where
the full matrix's would."""

from __future__ import annotations

import contextlib
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
    scalar = _scalar_estimate(W, T, n, wmax, (c, pp - 1, cap, me, None, None, 0))
    assert math.isfinite(scalar)
    assert scalar == pytest.approx(vector, rel=1e-12)
    if pp == 1:  # the greedy's inlined branch: W + c * ceil(T / cap)
        assert W + c * max(1, -(-T // cap)) == pytest.approx(vector, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 16), st.booleans(), st.sampled_from([0, 4, 8]))
def test_the_estimate_over_arrays_is_the_scalar_one_to_the_last_bit(seed, pp, lone, wrap):
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
    wrap = wrap if pp > 1 else 0  # an interleaved config has pp > 2
    vector = estimate_time(W, T, n, wmax, c, pp, cap, me, *extra, wrap=wrap)
    params = (c, pp - 1, cap, me, *(extra or (None, None)), wrap)
    scalar = [[_scalar_estimate(float(W[i, j]), int(T[i, j]), int(n[i, 0]), float(wmax[i, j]), params)
               for j in range(shape[1])] for i in range(shape[0])]
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


def full_matrix_swap(search, neck, partners: int, tol: float) -> bool:
    """The swap step as defined: both replicas' estimates for every pair, the first least (row-major) taken if
    it lowers the bottleneck. The local search estimates the partner only where the bottleneck gains."""
    from hydraulis.planner.local_search import _movable

    sums, table, bias, est, lengths, wg = search.sums, search.table, search.bias, search.est, search.lengths, search.wg
    b, items = neck.replica, neck.items
    top = est[b]
    for r in np.argsort(est)[:partners].tolist():
        mine = np.flatnonzero(search.replica_of == r)
        if r == b or len(mine) == 0:
            continue
        mine, w_rm, wmax_wo_r = _movable(mine, wg[table.group[r]], lengths)
        s_k, s_m = lengths[items], lengths[mine]
        w_bm, w_rk = wg[table.group[b], mine], wg[table.group[r], items]
        e_b = estimate_time(sums.W[b] - neck.w[:, None] + w_bm[None, :], sums.T[b] - s_k[:, None] + s_m[None, :],
                            sums.n[b], np.maximum(neck.wmax_without[:, None], w_bm[None, :]),
                            *[x[b] for x in table.params]) + bias[b]
        e_r = estimate_time(sums.W[r] - w_rm[None, :] + w_rk[:, None], sums.T[r] - s_m[None, :] + s_k[:, None],
                            sums.n[r], np.maximum(wmax_wo_r[None, :], w_rk[:, None]),
                            *[x[r] for x in table.params]) + bias[r]
        worst = np.maximum(e_b, e_r)
        worst[table.lone_cap[r] < s_k, :] = np.inf
        worst[:, table.lone_cap[b] < s_m] = np.inf
        k, m = np.unravel_index(int(np.argmin(worst)), worst.shape)
        if worst[k, m] < top - tol:
            search.move(items[k], b, r)
            search.move(mine[m], r, b)
            search.refresh(b, r)
            return True
    return False


@settings(max_examples=40, deadline=None)
@given(which=st.sampled_from(DEPLOYMENTS), n=st.integers(2, 200), seed=st.integers(0, 2**16), policies=st.booleans())
def test_the_local_search_swaps_as_the_full_matrix_does(which, n, seed, policies):
    """The swap step estimates the partner replica only for pairs where the bottleneck gains: the search ends
    where the full matrix's would, from greedy and random starts, with lone micro-batches and policies."""
    from hydraulis.planner import local_search as ls

    rng = np.random.default_rng(seed)
    table = ReplicaTable.of(COST.with_policies(policies), Deployment.parse(which, CLUSTER), 16)
    lengths = rng.integers(1, int(table.lone_cap.max()) // rng.choice([1, 4, 16]), n)
    lengths = np.minimum(lengths, int(table.lone_cap.max()))
    starts = [rng.integers(0, len(table), n)]
    with contextlib.suppress(dispatch.NoRoom):
        starts.append(greedy_dispatch(lengths, table))
    bias = rng.uniform(0, 0.5, len(table))
    for start in starts:
        if not np.isfinite(dispatch.estimated_times(lengths, table, start)).all():
            continue  # a random start past a lone cap: no search starts there
        fast = ls.local_search(lengths, table, start, bias)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ls, "_best_swap", full_matrix_swap)
            slow = ls.local_search(lengths, table, start, bias)
        assert np.array_equal(fast, slow)
