"""Chunked long sequences as a schedule (planner/oracles/chunk_schedule.py): the chunks' real order on a pipeline
against the simulator's lone micro-batch, the oracle's bound (cost/chunks.py) and the memory cap; and their
placement on a schedule's replicas."""

from __future__ import annotations

import functools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.cost.chunks import chunk_sizes, chunked_stage_time, kv_share, lone_cap
from hydraulis.parallel import Deployment
from hydraulis.planner.oracles.chunk_schedule import (
    chunk_pass,
    chunk_run,
    chunk_time,
    fastest_pass,
    in_chunks,
    place_chunked,
    plan_chunked,
)
from hydraulis.planner.phases import PhasedPlanner
from hydraulis.planner.sim import simulate_replica
from hydraulis.specs import ClusterSpec

COST = load_cost_model("llama-7b@a800-80g+cp").with_policies(True)
N = 64
CONFIGS = [g for g in COST.with_interleaving().configs if g.num_gpus <= 16]


@settings(max_examples=15, deadline=None)
@given(i=st.integers(0, len(CONFIGS) - 1), length=st.integers(256, 60_000))
def test_one_chunk_is_the_simulators_lone_micro_batch(i, length):
    g = CONFIGS[i]
    policy = COST.policies(g)[0]
    run = in_chunks(COST, g, length, length, policy)
    lone = simulate_replica([COST.stage_time(g, [length], policy)], g.pp, [COST.p2p_time(g, length)], vp=g.vp)
    assert run.k == 1
    assert np.isclose(chunk_time(run), lone.time_s, rtol=1e-12)


@settings(max_examples=15, deadline=None)
@given(i=st.integers(0, len(CONFIGS) - 1), length=st.integers(40_000, 600_000))
def test_a_pass_is_never_below_the_oracle_holds_its_memory_and_each_rank_runs_all_its_work(i, length):
    g = CONFIGS[i]
    run = chunk_run(COST, g, N, length)
    oracle = chunked_stage_time(COST, [g], N, np.array([length]))[0, 0]
    if run is None:  # nothing runs it in busy chunks: neither does the oracle
        assert np.isinf(oracle)
        return
    assert run.chunk <= chunk_sizes(COST, [g], N, np.array([length]), run.policy)[0, 0]
    if run.k > 1:  # one chunk's activations beside the whole sequence's K/V, their gradient and stage inputs
        assert run.chunk + kv_share(COST, g, run.policy) * length <= lone_cap(COST, g, N, run.policy)
    ends, busy = chunk_pass(run)
    assert np.allclose(busy, run.stage_s, rtol=1e-12)
    whole = COST.stage_time(g, [length], run.policy) if length <= lone_cap(COST, g, N, run.policy) else np.inf
    assert chunk_time(run) >= min(oracle, whole) * (1 - 1e-12)  # never below its least work: whole or chunked
    if g.pp == 1:  # serial on one stage: exactly its work
        assert np.isclose(ends.max(), run.stage_s, rtol=1e-12)


def test_the_oracle_is_the_largest_chunks_work_on_one_stage():
    g = next(g for g in CONFIGS if g.name == "tp1pp2cp4")
    s, checked = 150_000, 0
    for policy in COST.policies(g):
        chunk = int(chunk_sizes(COST, [g], N, np.array([s]), policy)[0, 0])
        oracle = chunked_stage_time(COST, [g], N, np.array([s]), policy)[0, 0]
        if 1024 <= chunk < s:  # beyond the lone cap: chunks
            assert np.isclose(in_chunks(COST, g, s, chunk, policy).stage_s, oracle, rtol=1e-12)
            checked += 1
        else:  # whole within the lone cap, or no busy chunk: not the oracle's
            assert np.isinf(oracle)
    assert checked


def test_a_later_start_on_one_rank_delays_the_pass_by_at_most_that():
    g = next(g for g in CONFIGS if g.name == "tp1pp4cp2")
    run = chunk_run(COST, g, N, 200_000)
    alone = chunk_time(run)
    late = chunk_pass(run, [0.0, 0.0, 0.0, 3.0])[0].max()
    assert alone <= late <= alone + 3.0


@functools.cache
def _planner() -> PhasedPlanner:
    cluster = ClusterSpec(16)
    cost = load_cost_model("llama-7b@a800-80g+cp")
    pool = [Deployment.parse(t, cluster) for t in ("8x(tp1,pp2)", "2x(tp1,pp2,cp4)")]
    return PhasedPlanner(cost, 16, pool)


def test_placing_chunked_sequences_counts_every_replicas_time():
    planner = _planner()
    rng = np.random.default_rng(3)
    rest = np.minimum(rng.lognormal(8.5, 0.9, 60).astype(np.int64) + 64, 16_000)
    schedule = planner.schedule(rest)
    same = place_chunked(schedule, planner.cost, 16, rest, [])
    assert same is not None and np.isclose(same[1], schedule.iteration_time_s, rtol=1e-12)
    lengths = np.append(rest, [90_000, 70_000])
    placed, time_s = place_chunked(schedule, planner.cost, 16, lengths, [60, 61])
    assert [q.position for q in placed] == [60, 61]  # the longest first
    assert time_s > schedule.iteration_time_s
    for q in placed:
        config = schedule.phases[q.phase].deployment.configs[q.replica]
        assert q.run.config == config and q.run.length == lengths[q.position]


def test_a_chunked_schedule_runs_every_sequence_once_and_nothing_beats_a_pass_alone():
    planner = _planner()
    rng = np.random.default_rng(4)
    lengths = np.append(np.minimum(rng.lognormal(8.5, 0.9, 40).astype(np.int64) + 64, 16_000), [90_000, 70_000])
    configs = [g for d in planner.pool for g in d.configs]
    out = plan_chunked(planner.schedule, planner.cost, 16, lengths, [[40, 41]], configs)
    assert out is not None
    assert sorted([*out.rest, *(q.position for q in out.placed)]) == list(range(len(lengths)))
    assert out.iteration_time_s >= fastest_pass(planner.cost, configs, 16, 90_000)
    assert plan_chunked(planner.schedule, planner.cost, 16, lengths, [[40, 41]], configs,
                        beat=fastest_pass(planner.cost, configs, 16, 90_000)) is None
