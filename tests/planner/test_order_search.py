"""The order search of a replica's packing (`packing.fastest_packing`) skips simulations by bounds; it must choose
what simulating every packing in every order, one after the other, chooses."""

from __future__ import annotations

import functools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner import sim
from hydraulis.planner.order_search import after_each, prepare, replica_time_below
from hydraulis.planner.packing import (
    BULK_PACK_ITEMS,
    execution_orders,
    fastest_packing,
    ramp_bins,
    stage_times,
)
from hydraulis.planner.planner import Planner
from hydraulis.planner.replicas import ReplicaCost
from hydraulis.planner.sim import simulate_replica
from hydraulis.specs import ClusterSpec

GPUS = 16


@functools.cache
def replica(pp: int, vp: int) -> tuple[ReplicaCost, object]:
    cost = load_cost_model("llama-7b@a800-80g").with_interleaving()
    return ReplicaCost.of(cost, ParallelConfig(1, pp, 1, vp), GPUS), cost


def one_by_one(candidates, lengths, rep, cost):
    """Every candidate in each of its orders simulated in turn; the first of the least time kept."""
    best = None
    for mbs, ramped in candidates:
        tokens, times = stage_times(mbs, lengths, rep, cost)
        comm = np.array([cost.p2p_time(rep.config, t) for t in tokens.tolist()])
        orders = execution_orders(times)
        if ramped:
            orders = orders[1::3]
        elif sum(len(mb) for mb in mbs) >= BULK_PACK_ITEMS:
            orders = orders[2:]
        for order in orders:
            t = simulate_replica(times[order], rep.pp, comm[order], keep_events=False, vp=rep.config.vp).time_s
            if best is None or t < best[0]:
                best = (t, [mbs[k] for k in order.tolist()])
    return best


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(64, 6000), min_size=2, max_size=60),
       st.sampled_from([(2, 1), (4, 1), (4, 2), (4, 4), (8, 2)]), st.integers(0, 3))
def test_the_search_chooses_what_simulating_every_order_chooses(batch, shape, seed):
    rep, cost = replica(*shape)
    lengths = np.minimum(np.array(batch), rep.cap)  # each within the replica's cap for any count (4,224 at pp 4, vp 4)
    rng = np.random.default_rng(seed)
    # Random packings beside the ramps, some equal to others (their times repeat).
    candidates = []
    for k in (1, 2, 3, 5):
        bin_of = rng.integers(0, k, len(batch))
        candidates.append(([np.flatnonzero(bin_of == b) for b in range(k) if (bin_of == b).any()], False))
    candidates += [(bins, True) for bins in ramp_bins(lengths, rep)] + candidates[:1]
    got = fastest_packing(candidates, lengths, rep, cost)
    want_s, want_order = one_by_one(candidates, lengths, rep, cost)
    assert got.time_s == want_s
    assert [mb.tolist() for mb in got.micro_batches] == [mb.tolist() for mb in want_order]


def test_a_bulk_packing_of_two_micro_batches_still_gets_an_order():
    """Bulk packings try only the orders with small micro-batches at the ends, which two micro-batches do not
    have: where every candidate is such a packing (a replica packed again at its own count), it is still ordered
    (this raised an AssertionError in the 1,024-GPU proposal of `benchmarks/planning_time.py`)."""
    rep, cost = replica(4, 2)
    lengths = np.full(2 * BULK_PACK_ITEMS, 64)
    mbs = [np.arange(BULK_PACK_ITEMS), np.arange(BULK_PACK_ITEMS, 2 * BULK_PACK_ITEMS)]
    got = fastest_packing([(mbs, False)], lengths, rep, cost, bulk=True)
    _, times = stage_times(mbs, lengths, rep, cost)
    comm = np.array([cost.p2p_time(rep.config, 64 * BULK_PACK_ITEMS)] * 2)
    assert got.time_s == simulate_replica(times, rep.pp, comm, keep_events=False, vp=rep.config.vp).time_s
    assert len(got.micro_batches) == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(1e-3, 5.0), min_size=1, max_size=24), st.integers(2, 6), st.integers(1, 4),
       st.floats(0.0, 0.2))
def test_the_floor_and_the_early_stop_bound_the_simulation(times, pp, vp, comm_scale):
    """The floor and the time still to come after each event are never above what the simulation gives; the
    search's simulation gives its time unless told to beat less, and then gives up (inf) exactly where the time is
    above it."""
    t = np.array(times)
    comm = comm_scale * (1 + np.arange(len(t)) % 3)
    exact = simulate_replica(t, pp, comm, keep_events=False, vp=vp).time_s
    bounds = prepare(t[None], comm[None], pp, vp)
    assert bounds.floor[0] <= exact
    # After each event ends (the simulation's rows, in the same order) the iteration takes at least `after` more.
    ends = simulate_replica(t, pp, comm, vp=vp).events[:, 4]
    assert (ends[bounds.layout.sweep.by_stage] + after_each(bounds, 0) <= exact * (1 + 1e-9)).all()
    assert replica_time_below(t, pp, comm, vp) == exact
    assert replica_time_below(t, pp, comm, vp, exact) == exact
    assert replica_time_below(t, pp, comm, vp, exact * (1 + 1e-6)) == exact
    assert replica_time_below(t, pp, comm, vp, exact * (1 - 1e-6)) == np.inf


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(1e-3, 5.0), min_size=1, max_size=16), st.sampled_from([2, 4, 8]), st.integers(1, 3),
       st.lists(st.floats(0.98, 1.02), min_size=1, max_size=6))
def test_a_simulation_met_again_answers_as_simulating_again(times, pp, vp, beats):
    """`time_below` keeps finished times and the beats it gave up at: asked again, at any beat in any order, it
    answers what a simulation without that memory answers."""
    t = np.array(times)
    comm = 0.01 * (1 + np.arange(len(t)) % 3)
    exact = simulate_replica(t, pp, comm, keep_events=False, vp=vp).time_s
    fresh = []
    for ratio in beats:
        sim.forget()
        fresh.append(replica_time_below(t, pp, comm, vp, exact * ratio))
    assert [replica_time_below(t, pp, comm, vp, exact * ratio) for ratio in beats] == fresh


class _WholeRounds(Planner):
    """The refinement as it was: every replica of a round packed in full, the round dropped after."""

    def _pack(self, lengths, table, d, packed=None, beat=np.inf, first=None):
        packs = super()._pack(lengths, table, d, packed)
        return None if max(p.time_s for p in packs) >= beat else packs


@functools.cache
def planners() -> tuple[Planner, Planner]:
    cost = load_cost_model("llama-7b@a800-80g").with_interleaving()
    cluster = ClusterSpec(GPUS)
    pool = [Deployment.parse(t, cluster) for t in ("2x(tp1,pp4,vp2) + 4x(tp2,pp1)", "2x(tp2,pp2) + 2x(tp1,pp4)")]
    return Planner(cost, GPUS, pool), _WholeRounds(cost, GPUS, pool)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(64, 12000), min_size=4, max_size=120))
def test_a_round_that_stops_at_its_first_miss_plans_what_a_whole_round_plans(batch):
    fast, whole = planners()
    a, b = fast.plan(np.array(batch)), whole.plan(np.array(batch))
    assert a.deployment == b.deployment
    assert a.predicted_time_s == b.predicted_time_s
    assert [r.micro_batches for r in a.replicas] == [r.micro_batches for r in b.replicas]
