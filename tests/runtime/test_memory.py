"""Memory the model predicts against memory torch's allocator measures, on 4 gloo ranks."""

from __future__ import annotations

import json

import pytest
from dist_launcher import run_workers
from exchange_workers import train_small

from hydraulis.training.run_log import summarize

BUCKET = 4 << 20
STEPS = 2  # each planned and measured anew, the first with its one-time setup (a third cost about 20 s of CI)


PIPELINES = ("2x(tp1,pp2)", "2x(tp1,pp2,vp2)")  # plain and interleaved 1F1B (chunks of two layers)
PIPELINE_ERROR = 0.05
# Interleaved with every weight gradient deferred to the stage's end (zero-bubble W's: the most they hold)
DEFERRED = "2x(tp1,pp2,vp2) end"


@pytest.fixture(scope="module")
def small_runs():
    return run_workers(train_small, 4, STEPS, BUCKET, (*PIPELINES, DEFERRED), deadline_s=400)


@pytest.mark.dist
def test_small_on_four_ranks_peaks_as_predicted_and_the_exchange_within_three_buckets(small_runs):
    metrics = small_runs[0]["metrics"]
    assert len(metrics) == STEPS
    for m in metrics:
        assert 0 < m["exchange_peak_bytes"] <= 3 * BUCKET, m["exchange_peak_bytes"]
        # Every rank's measured peak within 15% of its prediction (memory_error is the worst rank's).
        figures = (m["memory_peak_bytes"], m["memory_predicted_bytes"], m["micro_batches"])
        assert m["memory_error"] <= 0.15, figures
        # Not a vacuous bound: the parameters (31.6M x 4 bytes) and the owned state (31.6M / 4 x 16 bytes)
        # alone are 240 MiB per rank, and the activations of a few hundred tokens about as much again.
        assert m["memory_peak_bytes"] > 300 * 2**20, figures
    summary = summarize(metrics)
    assert summary["exchange_peak_bytes"] == max(m["exchange_peak_bytes"] for m in metrics)
    assert summary["memory_error_max"] <= 0.15
    json.dumps(summary)


@pytest.mark.dist
@pytest.mark.parametrize("pool", PIPELINES)
def test_pipelined_small_peaks_within_five_percent_of_the_memory_model_on_every_stage(small_runs, pool):
    """Every rank of `small` under plain and interleaved 1F1B: its measured peak (the allocator's) within 5% of
    `rank_memory`'s. The first stage's peak is the embedding's backward (a dense fp32 gradient of the 50,304-row
    table, 49 MiB, beside the gradients, the reduce's buffers and the chunks still in flight): uncounted, it
    was predicted 11-13% low under 1F1B and 20.6% low interleaved (where the gradients were also counted
    beside a whole micro-batch's chunks, not chunk by chunk)."""
    rows = [(rank, step, *figures[:3]) for rank, r in enumerate(small_runs) for step, figures in enumerate(
        r["pipelines"][pool])]
    assert {stage for _, _, stage, _, _ in rows} == {0, 1} and len(rows) == 4 * STEPS
    for rank, step, stage, peak, predicted in rows:
        assert peak > 250 * 2**20, (rank, step)  # measured, and the state alone is 210 MiB
        assert abs(peak - predicted) / predicted <= PIPELINE_ERROR, (pool, rank, step, stage, peak, predicted)


@pytest.mark.dist
def test_deferred_weight_gradients_peak_within_15_percent_of_the_model(small_runs):
    """Interleaved with every W at its stage's end: each rank's measured peak within 15% of the memory model's
    (fused) prediction plus what deferral adds in the zero-bubble oracle's accounting (exchange_workers.
    deferral_bytes: the linears' inputs and output gradients of every chunk, `weight_grad_bytes`). Counted only
    in the order's bytes held (`order_peak`'s accounting), the first stage was predicted 11-12% low (and +0 bytes):
    its peak is the embedding's dense gradient in the first B of its chunk, with the W's of the B's before held."""
    fused = {(rank, step): figures for rank, r in enumerate(small_runs)
             for step, figures in enumerate(r["pipelines"]["2x(tp1,pp2,vp2)"])}
    rows = [(rank, step, *figures) for rank, r in enumerate(small_runs)
            for step, figures in enumerate(r["pipelines"][DEFERRED])]
    for rank, step, stage, peak, predicted, added in rows:
        print(f"rank {rank} step {step} stage {stage}: peak {peak / 2**20:.1f} MiB, model {predicted / 2**20:.1f} "
              f"+ {added / 2**20:.1f}; fused peak {fused[rank, step][1] / 2**20:.1f}")
    for rank, step, stage, peak, predicted, added in rows:
        # within 4% measured (2026-12-07); the issue asks 15%
        assert abs(peak - predicted - added) / (predicted + added) <= 0.10, (rank, step, stage, peak, predicted, added)
        if stage == 0:  # not vacuous: there the W's held beside the embedding's gradient raise the peak by 10-13%
            assert added > 0.05 * predicted and peak > 1.05 * fused[rank, step][1], (rank, step, peak, added)


def test_cpu_iterations_are_sampled_first_use_of_each_deployment_and_every_nth_step():
    """The CPU trace costs a large share of a small step: only due iterations are measured, others say 0."""
    import torch

    from hydraulis.runtime.metering.step_memory import StepMemory

    memory = StepMemory(torch.device("cpu"), every=4)
    measured = []
    for step, deployment in enumerate([0, 0, 1, 1, 0, 1, 2]):
        memory.start(deployment, step, predicted=1e6)
        x = torch.ones(1 << 18)  # 1 MiB, alive at the stop: every measured peak includes it
        figures = memory.stop()
        del x
        measured.append(figures.peak > 0)
        assert figures.predicted == 1_000_000
        if figures.peak == 0:
            assert figures.error == 0.0 and figures.exchange_peak == 0
    # step 0: deployment 0 first; 2: deployment 1 first; 4: every 4th; 6: deployment 2 first
    assert measured == [True, False, True, False, True, False, True]


def test_under_a_budget_the_riskiest_iterations_are_measured_too():
    """With [parallel] memory_per_rank, an iteration whose predicted peak is the highest yet is measured as well
    (those are the ones that could break the budget); without one, the same predictions change nothing."""
    import torch

    from hydraulis.runtime.metering.step_memory import StepMemory

    predicted = [5e6, 4e6, 6e6, 6e6, 7e6, 3e6]
    for budget, expected in ((None, [True] + [False] * 5), (8 << 20, [True, False, True, False, True, False])):
        memory = StepMemory(torch.device("cpu"), every=100, budget=budget)
        seen = []
        for step, p in enumerate(predicted):
            memory.start(0, step, predicted=p)
            x = torch.ones(1 << 18)  # 1 MiB: every measured peak includes it
            seen.append(memory.stop().peak > 0)
            del x
        assert seen == expected


def test_a_collectives_buffer_is_released_here_once_another_thread_lets_go_and_never_waited_on_for_long():
    """What a gloo worker does: it holds a view of the buffer a moment after the collective returned."""
    import threading
    import time

    import torch

    from hydraulis.runtime.parallelism import collectives
    from hydraulis.runtime.parallelism.collectives import RELEASE_WAIT_S, storage_uses, wait_released

    buffer = torch.empty(1 << 10)
    uses = storage_uses(buffer)
    held = [buffer[:10]]  # the worker's reference
    assert storage_uses(buffer) == uses + 1

    def worker() -> None:
        time.sleep(0.01)
        held.clear()

    thread = threading.Thread(target=worker)
    thread.start()
    late = collectives.late_waits
    assert wait_released([(buffer, uses)])
    assert not held and storage_uses(buffer) == uses  # returned after the worker dropped its view
    thread.join()
    # A reference nobody drops: the wait gives up at its deadline (the meter may then over-count; nothing hangs).
    kept = buffer[:10]
    start = time.perf_counter()
    assert not wait_released([(buffer, uses)])
    assert time.perf_counter() - start >= RELEASE_WAIT_S and kept.numel() == 10
    assert collectives.late_waits == late + 1  # counted: the runtime's tests assert their runs have none


def test_a_census_waits_for_the_planner_planning_in_the_background(monkeypatch, quiet=None):
    """A CPU census holds every object of the process; a tuple the planner's thread was building from an
    iterator meanwhile had two references when it grew, and CPython failed the plan with "SystemError: bad
    argument to internal function" (seen once in CI, on 4 ranks). The feed's `paused` keeps the census out of
    planning. Here the planner builds tuples from iterators for a while before each plan, so every census falls
    inside planning; with `quiet=contextlib.nullcontext` this fails at the first census (tried by hand). The
    planner plans in this process's thread, as with HYDRAULIS_WORKERS=1 (else in a child: runtime/plan_server.py)."""
    monkeypatch.setenv("HYDRAULIS_WORKERS", "1")
    import threading
    import time

    import torch
    from train_workers import corpus, settings

    from hydraulis.data.sampler import TokenBudgetSampler
    from hydraulis.runtime.metering.step_memory import StepMemory
    from hydraulis.runtime.plan_feed import PlanFeed

    s = settings()
    feed = PlanFeed(TokenBudgetSampler([len(d) for d in corpus(s.model.vocab)], 700, 160, seed=1), s.parallel.pool,
                    s.parallel.cost, 0, 4, None)
    feed.world = 1  # its broadcast is then local: this process plans and reads its own plans
    schedule = feed.planner.schedule

    planning = threading.Event()

    def busy(lengths, step):
        planning.set()
        until = time.perf_counter() + 0.3
        while time.perf_counter() < until:
            tuple(x for x in range(100))
        return schedule(lengths, step)

    feed.planner.schedule = busy
    memory = StepMemory(torch.device("cpu"), every=1, quiet=quiet or feed.paused)
    try:
        for step in range(4):
            planning.clear()
            feed.next()  # the next batch's planning starts in the background
            assert planning.wait(30)
            memory.start(0, step, predicted=1e6)  # a census while it plans
            memory.stop()
            feed.step += 1
    finally:
        feed.close()
