"""The order of a pipeline stage's events: one table that the simulator times (planner/sim.py), the memory model
counts (cost/activations.py) and the runtime runs (runtime/pipeline/).

An event is (FORWARD or BACKWARD, micro-batch, model chunk); chunk c of stage s is virtual stage c * pp + s
(Megatron's layout). Plain 1F1B is the interleaved order with one chunk, under its own warm-up. `event_graph`
puts every stage's events in one order where each comes after what it waits for: the simulator times that graph,
the runtime's interleaved lockstep ticks it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# What a pipeline stage runs for a micro-batch: the simulator's timelines and the runtime's 1F1B name their events
# with these.
FORWARD, BACKWARD = 0, 1
WEIGHT = 2  # a backward's weight gradients, deferred (zero-bubble)

Event = tuple[int, int, int]  # (FORWARD or BACKWARD, micro-batch, chunk)


def warmup_count(pp: int, vp: int, micro_batches: int, stage: int) -> int:
    """Chunk forwards stage `stage` runs before its first backward, at most all M vp: under 1F1B pp - s - 1
    (Megatron-core's non-interleaved schedule), interleaved 2 (pp - s - 1) + (vp - 1) N (N: `interleave_group`)."""
    if vp == 1:
        return min(pp - stage - 1, micro_batches)
    return min(micro_batches * vp, 2 * (pp - stage - 1) + (vp - 1) * interleave_group(pp, micro_batches))


@functools.lru_cache(maxsize=4096)
def stage_order(pp: int, vp: int, micro_batches: int, stage: int) -> tuple[Event, ...]:
    """The events of stage `stage` in the order it runs them, interleaved 1F1B with `vp` chunks (vp = 1: 1F1B).

    Megatron-LM's schedule (core/pipeline_parallel/schedules.py: `get_schedule_table`,
    `get_pp_rank_microbatches`): the forwards go through groups of `interleave_group` micro-batches, every
    chunk of a group in turn, the backwards the same with the chunks reversed; a stage runs `warmup_count`
    forwards and then alternates one forward with one backward.
    """
    m, group = micro_batches, interleave_group(pp, micro_batches)
    table = []
    for first in range(0, m, group):
        last = m if first + group >= m else first + group  # Megatron's last group takes what is left
        table += [(j, c) for c in range(vp) for j in range(first, last)]
        if last == m:
            break
    total, warmup = m * vp, warmup_count(pp, vp, m, stage)
    forwards = [(FORWARD, j, c) for j, c in table]
    backwards = [(BACKWARD, j, vp - 1 - c) for j, c in table]
    order = forwards[:warmup]
    for k in range(total - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return tuple(order + backwards[total - warmup:])


def slots_error(order: Sequence[Event], slots: Sequence[int]) -> str | None:
    """What is wrong with a stage's weight slots (None: valid): one per backward of `order`, nondecreasing, each
    from its own backward's index to the order's last event."""
    at = [i for i, e in enumerate(order) if e[0] == BACKWARD]
    if len(slots) != len(at):
        return f"{len(slots)} weight slots for {len(at)} backwards; give one per backward"
    for k, (place, slot) in enumerate(zip(at, slots, strict=True)):
        if not place <= slot < len(order) or (k and slot < slots[k - 1]):
            return (f"weight slot {k} ({slot}) is before its backward ({place}), outside the stage's {len(order)} "
                    "events or before the slot ahead of it")
    return None


def with_weights(order: Sequence[Event], slots: Sequence[int]) -> tuple[Event, ...]:
    """A stage's order with its deferred weight gradients: (WEIGHT, micro-batch, chunk) of the i-th backward
    right after event `slots[i]` (the runtime's W's, runtime/parallelism/weight_grad.py), those of one slot oldest
    first. `slots` as `slots_error` checks; empty: none deferred (the order itself)."""
    if not slots:
        return tuple(order)
    if (error := slots_error(order, slots)) is not None:
        raise ValueError(error)
    backwards = [e for e in order if e[0] == BACKWARD]
    out, after = [], {}
    for slot, (_, j, c) in zip(slots, backwards, strict=True):
        after.setdefault(slot, []).append((WEIGHT, j, c))
    for i, event in enumerate(order):
        out += [event, *after.get(i, ())]
    return tuple(out)


def one_f_one_b_order(pp: int, v: int, stage: int) -> list[tuple[int, int]]:
    """(kind, micro-batch) in the order stage `stage` runs them under 1F1B (`stage_order` with one chunk)."""
    return [(kind, j) for kind, j, _ in stage_order(pp, 1, v, stage)]


def interleaved_order(pp: int, vp: int, m: int, stage: int) -> list[Event]:
    """(kind, micro-batch, chunk) in the order stage `stage` runs them (`stage_order`, as a list)."""
    return list(stage_order(pp, vp, m, stage))


def depends_on(pp: int, vp: int, stage: int, kind: int, chunk: int) -> tuple[int, int, int] | None:
    """(stage, kind, chunk) of the event an event waits for, the same micro-batch's; None: the first forward.
    Virtual stage chunk * pp + stage; a forward waits for the one before, a backward for the one after, the last
    virtual stage's backward for its own forward."""
    virtual = chunk * pp + stage
    if kind == FORWARD:
        return None if virtual == 0 else ((virtual - 1) % pp, FORWARD, (virtual - 1) // pp)
    if virtual == pp * vp - 1:
        return stage, FORWARD, chunk
    return (virtual + 1) % pp, BACKWARD, (virtual + 1) // pp


@functools.lru_cache(maxsize=4096)
def interleave_group(pp: int, micro_batches: int) -> int:
    """Megatron's micro-batch group of interleaved 1F1B (microbatch_group_size_per_vp_stage) for M micro-batches:
    the smallest N >= pp whose last group is whole or holds at least pp (Megatron refuses a shorter last group,
    and its order then deadlocks); M itself below pp (every forward is then in the warm-up). Megatron's default is
    pp with M a multiple of pp; a plan's micro-batch counts vary, so each replica gets the smallest that runs."""
    if micro_batches <= pp:
        return max(1, micro_batches)
    return next(n for n in range(pp, micro_batches + 1) if micro_batches % n == 0 or micro_batches % n >= pp)


@dataclass(frozen=True)
class EventGraph:
    """The events of pp stages and M micro-batches (vp chunks each) in an order where each comes after what it
    waits for: per event its stage, kind, micro-batch and chunk, the previous event on its stage and the event it
    depends on (`depends_on`; -1: none), as indices into this order."""

    stage: tuple[int, ...]
    kind: tuple[int, ...]
    micro_batch: tuple[int, ...]
    chunk: tuple[int, ...]
    prev: tuple[int, ...]
    dep: tuple[int, ...]
    last: tuple[int, ...]  # each stage's last event


@functools.lru_cache(maxsize=256)
def event_graph(pp: int, vp: int, micro_batches: int) -> EventGraph:
    """Sweep the stages, each advancing through its `stage_order` until an input is not ready yet: the order in
    which the events become computable (the simulator's event rows keep it). `event_arrays`, as tuples."""
    a = event_arrays(pp, vp, micro_batches)
    cols = (a.stage, a.kind, a.micro_batch, a.chunk, a.prev, a.dep, a.last)
    stage, kind, mb, chunk, prev, dep, last = (tuple(x.tolist()) for x in cols)
    return EventGraph(stage=stage, kind=kind, micro_batch=mb, chunk=chunk, prev=prev, dep=dep, last=last)


@dataclass(frozen=True)
class EventArrays:
    """`EventGraph`'s columns as integer arrays (the simulator's, built without a Python object per event field)."""

    stage: np.ndarray
    kind: np.ndarray
    micro_batch: np.ndarray
    chunk: np.ndarray
    prev: np.ndarray
    dep: np.ndarray
    last: np.ndarray


def stage_tables(pp: int, vp: int, micro_batches: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every stage's `stage_order` as arrays [pp, 2 M vp]: kind, micro-batch and chunk of each place. The
    forwards' table (j, c) is the same on every stage; stage s runs its first w forwards, then forward w + k and
    backward k in turn, then the backwards left, so forward k sits at k (k < w) or 2 k - w, backward k at
    2 k + w + 1 (k < total - w) or total + k."""
    m, group = micro_batches, interleave_group(pp, micro_batches)
    firsts = list(range(0, m, group))
    lasts = [m if first + group >= m else first + group for first in firsts]
    cut = next((k for k, last in enumerate(lasts) if last == m), len(lasts) - 1)  # Megatron's last group
    j = np.concatenate([np.tile(np.arange(a, b), vp) for a, b in zip(firsts[: cut + 1], lasts, strict=False)])
    c = np.concatenate([np.repeat(np.arange(vp), b - a) for a, b in zip(firsts[: cut + 1], lasts, strict=False)])
    total, k = m * vp, np.arange(m * vp)
    kind, mb, chunk = (np.empty((pp, 2 * total), dtype=np.int64) for _ in range(3))
    for s in range(pp):
        w = warmup_count(pp, vp, m, s)
        fwd, bwd = np.where(k < w, k, 2 * k - w), np.where(k < total - w, 2 * k + w + 1, total + k)
        kind[s, fwd], mb[s, fwd], chunk[s, fwd] = FORWARD, j, c
        kind[s, bwd], mb[s, bwd], chunk[s, bwd] = BACKWARD, j, vp - 1 - c
    return kind, mb, chunk


@functools.lru_cache(maxsize=256)
def event_arrays(pp: int, vp: int, micro_batches: int) -> EventArrays:
    """`event_graph`'s sweep on integer tables: each event's input (`depends_on`) found by its place in its
    stage's order, then the sweep over stage-major event numbers, one plain loop step per event (a place per event,
    the order its inverse)."""
    if micro_batches == 0:
        none = np.zeros(0, dtype=np.int64)
        return EventArrays(stage=none, kind=none, micro_batch=none, chunk=none, prev=none, dep=none,
                           last=np.full(pp, -1))
    kind, mb, chunk = stage_tables(pp, vp, micro_batches)
    n, P = kind.shape[1], pp * vp
    s = np.arange(pp)[:, None]
    place = np.empty((pp, 2, vp, micro_batches), dtype=np.int64)  # (stage, kind, chunk, j) -> its place
    place[np.broadcast_to(s, kind.shape), kind, chunk, mb] = np.arange(n)
    virtual = chunk * pp + s
    forward = kind == FORWARD
    up = np.where(forward, virtual - 1, np.where(virtual == P - 1, virtual, virtual + 1))  # the input's virtual
    on_stage, on_kind = up % pp, np.where(forward | (virtual == P - 1), FORWARD, BACKWARD)
    dep = np.where(forward & (virtual == 0), -1, on_stage * n + place[on_stage, on_kind, up // pp, mb])
    total = pp * n  # the sweep's input slot `total`: none, seen from the start; an event's place in the order
    inputs = np.where(dep < 0, total, dep).ravel()
    deps, seen, count = inputs.tolist(), [-1] * total + [0], 0
    ptr, ends = list(range(0, total, n)), list(range(n, total + 1, n))
    while count < total:
        before = count
        for q in range(pp):
            e, end = ptr[q], ends[q]
            while e < end and seen[deps[e]] >= 0:
                seen[e] = count
                count += 1
                e += 1
            ptr[q] = e
        if count == before:
            raise RuntimeError(f"the pipeline order deadlocked (pp={pp}, vp={vp}, {micro_batches} micro-batches)")
    at, g = np.array(seen, dtype=np.int64), np.empty(total, dtype=np.int64)
    at[total] = -1  # none
    g[at[:total]] = np.arange(total)  # the events in the sweep's order
    first = g % n == 0
    return EventArrays(stage=g // n, kind=kind.ravel()[g], micro_batch=mb.ravel()[g], chunk=chunk.ravel()[g],
                       prev=np.where(first, -1, at[g - 1]), dep=at[inputs[g]],
                       last=at[np.arange(1, pp + 1) * n - 1])
