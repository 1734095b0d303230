"""The memory model's pipeline schedule (cost/activations.py) against the simulator's order, and interleaved caps."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import load_cost_model
from hydraulis.cost.activations import (
    COUNT_HORIZON,
    backward_index,
    count_horizon,
    embedding_backward,
    held_after,
    in_flight,
)
from hydraulis.cost.memory import _most_tokens, rank_memory
from hydraulis.cost.policies import MemoryPolicy
from hydraulis.parallel import ParallelConfig
from hydraulis.pipeline_order import BACKWARD, FORWARD, interleave_group, interleaved_order


@pytest.mark.parametrize(("pp", "vp"), [(2, 1), (4, 1), (2, 2), (3, 2), (4, 2), (2, 4), (3, 3)])
def test_backward_positions_and_chunks_held_are_the_simulators_order(pp, vp):
    """Walking `interleaved_order` (planner/sim.py) event by event: each backward's position, the chunks held
    once it freed its chunk (and after the forward that follows it), and the most held at once."""
    config = ParallelConfig(1, pp, vp=vp)
    for m in range(1, 4 * pp + 2):
        for stage in range(pp):
            order = interleaved_order(pp, vp, m, stage)
            held, most, k = 0, 0, -1
            for i, (kind, j, chunk) in enumerate(order):
                held += 1 if kind == FORWARD else -1
                most = max(most, held)
                if kind != BACKWARD:
                    continue
                k += 1
                assert backward_index(config, m, j, chunk) == k, (m, stage, j, chunk)
                refilled = held + (i + 1 < len(order) and order[i + 1][0] == FORWARD)
                assert (held_after(config, stage, m, k, refill=False), held_after(config, stage, m, k)) == (
                    held, refilled), (m, stage, k)
            assert most == in_flight(config, stage, m)


def test_an_interleaved_cap_holds_for_every_count_and_the_embeddings_backward_binds_small():
    """The cap for any count fits every count of at least two to 12 pp on every stage and, on the stages it checks,
    each count to the horizon whose group outgrows every smaller count's (once it fit only the count with the
    largest warm-up: llama-32b tp2pp6 vp2 went 2.6 GB over at 19 micro-batches; then the counts to 4 pp:
    llama-70b tp1pp8cp8vp5 at 128 GPUs held 5,760 tokens, 67 and 111 micro-batches 5,504). On `small` in bf16
    the embedding's dense gradient (50,304 x 256 x 2 bytes) beside every gradient binds the first stage."""
    cost = load_cost_model("llama-32b@a800-80g+cp")
    mem, spec = cost.memory, cost.model
    for config in (ParallelConfig(2, 6, vp=2), ParallelConfig(2, 4, vp=5), ParallelConfig(4, 2, cp=2, vp=2)):
        cap = mem.cap(config, spec, 64)
        assert cap > 0
        groups = np.maximum.accumulate([interleave_group(config.pp, m) for m in range(COUNT_HORIZON + 1)])
        grown = np.flatnonzero(groups[1:] > groups[:-1]) + 1
        for stage in range(config.pp):
            far = grown if stage in (0, config.pp - 1) else []
            for m in sorted({*range(2, 12 * config.pp + 1), *(int(m) for m in far if m > 1)}):
                rank = rank_memory(mem, spec, config, stage, 64, cap, 2, mem.exchange_bucket_bytes, micro_batches=m)
                assert rank.peak <= mem.usable_bytes, (config, stage, m)
    long = load_cost_model("llama-70b@h100-80g+cp")
    config = ParallelConfig(1, 8, 8, 5)
    assert long.memory.cap(config, long.model, 128) <= min(
        long.memory.cap(config, long.model, 128, micro_batches=m) for m in (25, 67, 111, 157, 631))
    small = load_cost_model("small@cpu")
    first = rank_memory(small.memory, small.model, ParallelConfig(1, 2, vp=2), 0, 4, 256, 2, 4 << 20,
                        micro_batches=3)
    table = small.model.vocab_rows * small.model.hidden * 2
    assert first.embedding_backward >= table
    assert first.with_activations == first.grads + first.embedding_backward
    # Without it (as before), the first stage's peak would be the activations' phase, 15-20% lower.
    assert first.with_activations > 1.1 * dataclasses.replace(first, embedding_backward=0.0).with_activations


@pytest.mark.parametrize(("name", "config", "num_gpus", "policy", "mosts"), [
    ("llama-70b@h100-80g+cp", ParallelConfig(1, 8, 8, 5), 64, MemoryPolicy.FULL, (9, 20, 66, 67, 132, 140)),
    ("llama-32b@a800-80g+cp", ParallelConfig(2, 4, vp=5), 64, MemoryPolicy.NONE, (5, 30, 31, 50)),
])
def test_the_cap_to_a_horizon_is_the_least_cap_of_its_counts(name, config, num_gpus, policy, mosts):
    """The cap for the counts a batch of n sequences may pack (2..n, `count_horizon`), by a bisection at every
    count (each count's own cap): at most every count's to n, and exactly the least of the counts to the horizon,
    which covers n and ends before the next count whose warm-up outgrows the smaller counts'. 70B tp1pp8cp8vp5 at
    64 GPUs under full recompute: 68,352 tokens for 132 sequences, 65,536 for 140 (M = 133's), 54,272 to 1,024."""
    cost = load_cost_model(name)
    mem, spec = cost.memory, cost.model
    horizons = {most: count_horizon(config, most) for most in mosts}
    own = [mem.cap(config, spec, num_gpus, policy, micro_batches=m) for m in range(2, max(horizons.values()) + 1)]
    for most, horizon in horizons.items():
        cap = mem.cap(config, spec, num_gpus, policy, horizon=horizon)
        assert most <= horizon < COUNT_HORIZON and cap == min(own[: horizon - 1]), (most, horizon)
        assert cap >= mem.cap(config, spec, num_gpus, policy) and horizon == count_horizon(config, horizon)
    if config.pp == 8:
        assert [mem.cap(config, spec, num_gpus, policy, horizon=count_horizon(config, n)) for n in (132, 140)] == [
            68352, 65536]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=40), st.integers(0, 200), st.sampled_from([1, 7, 128]))
def test_the_cap_search_finds_the_largest_fitting_multiple(rises, free, step):
    """`_most_tokens` (a few guesses along lines, then halvings) against a scan: the largest multiple of `step`
    whose use fits, for uses that rise in uneven steps (flat runs, jumps) as `rank_memory`'s may."""
    edges = np.cumsum(rises)  # used(t) = the number of edges at or below t: nondecreasing, any shape
    free %= len(rises)  # below the most it uses: some multiple does not fit
    used = lambda t: float(np.searchsorted(edges, t, side="right"))  # noqa: E731
    scan = max((k * step for k in range(int(edges[-1]) // step + 2) if used(k * step) <= free), default=0)
    assert _most_tokens(used, free, step) == (scan if used(0) <= free else 0)


@pytest.mark.parametrize(("pp", "vp"), [(2, 1), (4, 1), (2, 2), (4, 3), (8, 5)])
def test_the_embeddings_backward_is_the_most_over_its_micro_batches(pp, vp):
    """`embedding_backward` (its chunks once per count) against its definition walked micro-batch by micro-batch:
    each chunk 0 backward beside the chunks then held, the reduce's buffers from its start, the first reducing
    one the last that counts."""
    config = ParallelConfig(1, pp, vp=vp)
    rng = np.random.default_rng(pp * 10 + vp)
    for m in range(1, 6 * pp):
        for start in (None, *rng.integers(0, m * vp, 3).tolist()):
            for scaled, one in ((False, 3e6), (True, 0.0), (True, -5.0)):
                worst = None
                for j in range(0 if scaled else 1, m):
                    k = backward_index(config, m, j, 0)
                    reducing = start is not None and k >= start
                    here = held_after(config, 0, m, k, refill=False) * one + 7e8 * reducing
                    worst = here if worst is None else max(worst, here)
                    if reducing:
                        break
                expected = 0.0 if worst is None else 1e9 + worst
                assert embedding_backward(config, m, scaled=scaled, table=1e9, one=one, start=start,
                                          exchange=7e8) == expected, (m, start, scaled)
