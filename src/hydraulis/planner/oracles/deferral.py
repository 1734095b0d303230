"""The length-aware zero-bubble schedule (issue 50, item 3): a plan's own (interleaved) 1F1B whose backwards' weight
gradients (W) run later, whole, in the gaps that unequal micro-batches leave, so B's input gradient goes upstream
sooner.

A stage's deferral is `slots`, one per backward of its `pipeline_order.stage_order`, in their order (FIFO: the i-th
W is the i-th B's): the place in the stage's order of the F or B after which that W runs, nondecreasing, each at
or after its own B (`pipeline_order.with_weights` expands them; all at their B: the fused backward). `defer_slots`
chooses them by the oracle's greedy rule (`zero_bubble.py`) made discrete: going through the events in a
topological order, each stage runs its oldest pending W's whole in the gap before its next event's input
arrives, as many as end by then (one that does not fit waits, and all after it, or with `spill` overruns the gap
by at most that share of itself); before a forward that would lift
the stage above its memory cap, and after a backward that does, the oldest run at once; what is left runs at the
stage's end. `time_deferred` times any slots exactly (B's output is sent at B's end), the simulator's time of a
plan that carries them (`sim.simulate`). Numpy-free loops over the events, as `sim.run_events`: O(events).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.model import FORWARD_SHARE, CostModel
from hydraulis.cost.policies import MemoryPolicy, derived_scales
from hydraulis.parallel import ParallelConfig
from hydraulis.pipeline_order import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    event_arrays,
    slots_error,
    stage_order,
    stage_tables,
    with_weights,
)

_EPS = 1e-9  # relative slack of a memory comparison (sums of bytes in another order)
Slots = tuple[tuple[int, ...], ...]  # per stage; an empty stage: fused


@dataclass(frozen=True)
class _Events:
    """`pipeline_order.event_arrays` as lists for the loops: per event its stage, whether a forward, micro-batch,
    chunk, input (-1: none), whether a send lies before it, its place in its stage's order and, for a backward,
    its number among its stage's backwards; per stage its backwards' (micro-batch, chunk) in order."""

    stage: list[int]
    forward: list[bool]
    micro_batch: list[int]
    chunk: list[int]
    dep: list[int]
    transfer: list[bool]
    place: list[int]
    backward: list[int]
    backwards: tuple[tuple[tuple[int, int], ...], ...]
    table_kind: np.ndarray  # [pp, 2 M vp]: `pipeline_order.stage_tables`' kinds and micro-batches
    table_micro_batch: np.ndarray
    length: int  # events per stage, 2 M vp


@functools.lru_cache(maxsize=256)
def _events(pp: int, vp: int, m: int) -> _Events:
    g = event_arrays(pp, vp, m)
    n, length = len(g.stage), 2 * m * vp
    place = np.empty(n, dtype=np.int64)
    place[np.argsort(g.stage, kind="stable")] = np.tile(np.arange(length), pp)
    kind, mb, chunk = stage_tables(pp, vp, m)
    number = np.cumsum(kind == BACKWARD, axis=1) - 1  # [stage, place] -> its backward's number
    backward = np.where(g.kind == BACKWARD, number[g.stage, place], -1)
    transfer = (g.dep >= 0) & (g.stage[np.maximum(g.dep, 0)] != g.stage)
    backwards = tuple(tuple(zip(mb[s][kind[s] == BACKWARD].tolist(), chunk[s][kind[s] == BACKWARD].tolist(),
                                strict=True)) for s in range(pp))
    return _Events(stage=g.stage.tolist(), forward=(g.kind == FORWARD).tolist(), micro_batch=g.micro_batch.tolist(),
                   chunk=g.chunk.tolist(), dep=g.dep.tolist(), transfer=transfer.tolist(), place=place.tolist(),
                   backward=backward.tolist(), backwards=backwards, length=length,
                   table_kind=kind, table_micro_batch=mb)


def order_peak(pp: int, vp: int, held: Sequence[float]) -> list[float]:
    """Each stage's most bytes held under the plan's own order, each W right after its B (a fused backward frees
    its chunk's activations layer by layer, a transient the memory model counts apart): its chunks in flight, each
    micro-batch's `held` bytes from its forward to its backward."""
    if len(held) == 0:
        return [0.0] * pp
    ev = _events(pp, vp, len(held))
    h = np.asarray(held, dtype=np.float64)[ev.table_micro_batch]
    return np.max(np.cumsum(np.where(ev.table_kind == FORWARD, h, -h), axis=1), axis=1, initial=0.0).tolist()


def deferred_peak(pp: int, vp: int, held: Sequence[float], weight_held: Sequence[float], slots: Slots) -> list[float]:
    """Each stage's most bytes held under its deferred order (`pipeline_order.with_weights`), counted as
    `defer_slots` counts them: after each F or B and the W's that follow it; a fused stage, `order_peak`'s."""
    fused = order_peak(pp, vp, held)
    peaks = []
    for s in range(pp):
        if not slots[s]:
            peaks.append(fused[s])
            continue
        events = with_weights(stage_order(pp, vp, len(held), s), slots[s])
        change = np.array([held[j] if kind == FORWARD else weight_held[j] - held[j] if kind == BACKWARD
                           else -weight_held[j] for kind, j, _ in events])
        boundary = np.r_[[kind != WEIGHT for kind, _, _ in events[1:]], True]  # before an F or B, and at the end
        peaks.append(float(np.max(np.cumsum(change)[boundary], initial=0.0)))
    return peaks


def _chunks(values: Sequence[float] | np.ndarray, vp: int) -> list[float]:
    return (np.asarray(values, dtype=np.float64) / vp).tolist()


def defer_slots(
    forward_s: Sequence[float], input_grad_s: Sequence[float], weight_grad_s: Sequence[float], pp: int, *,
    vp: int = 1, p2p_s: Sequence[float] | float = 0.0, held: Sequence[float] | None = None,
    weight_held: Sequence[float] | None = None, cap: Sequence[float] | None = None, fused_s: float | None = None,
    spill: float = 0.0, beat: float = np.inf,
) -> tuple[Slots, float]:
    """Each stage's slots by the greedy rule (module docstring) and the time of that order; where that is not
    faster than the fused backward, none (each stage ()) and the fused order's time. The arguments are
    `zero_bubble.zero_bubble_replica`'s: per micro-batch its forward, B and W seconds on one stage (all vp chunks),
    its p2p time, one chunk's activations and its deferred W's bytes; per stage the memory cap (at least what the
    plan's own order holds, `zero_bubble.order_peak`). Bytes are counted after each event and the W's after it.
    `fused_s`: the fused order's time where the caller has it (`sim.simulate_replica`'s, often kept). `spill`: a W
    runs in a gap it overruns by at most this share of its own length too (delaying the next event). `beat`: the
    greedy is given up (the fused order returned) once a stage's clock and its work still to run pass it, so the
    answer is the same wherever it is below `beat`."""
    m = len(forward_s)
    if m == 0 or pp == 1:
        return tuple(() for _ in range(pp)), float(np.sum(forward_s) + np.sum(input_grad_s) + np.sum(weight_grad_s))
    ev = _events(pp, vp, m)
    f, b, w = _chunks(forward_s, vp), _chunks(input_grad_s, vp), _chunks(weight_grad_s, vp)
    comm = np.broadcast_to(np.asarray(p2p_s, dtype=np.float64), (m,)).tolist()
    hf = [1.0] * m if held is None else [float(x) for x in held]
    hw = hf if weight_held is None else [float(x) for x in weight_held]
    own = order_peak(pp, vp, hf)
    caps = [o * (1 + _EPS) for o in own] if cap is None else [max(c, o) * (1 + _EPS) for c, o in zip(cap, own,
                                                                                                      strict=True)]
    clock, now, idle, keep, over = [0.0] * pp, [0.0] * pp, [0.0] * pp, 1.0 - spill, False
    # a stage ends after all its work (every stage's the same) and its idle time: past `beat` once that idles `slack`
    slack = beat * (1 + _EPS) - float(np.sum(forward_s) + np.sum(input_grad_s) + np.sum(weight_grad_s))
    pending: list[deque] = [deque() for _ in range(pp)]
    slots = [[ev.length - 1] * (m * vp) for _ in range(pp)]
    end = [0.0] * len(ev.stage)
    for e, (s, fwd, j, d, sent) in enumerate(zip(ev.stage, ev.forward, ev.micro_batch, ev.dep, ev.transfer,
                                                 strict=True)):
        ready = 0.0 if d < 0 else end[d] + (comm[j] if sent else 0.0)
        c, q = clock[s], pending[s]
        if q:
            at = ev.place[e] - 1
            if fwd:  # the cap binds: the oldest W's now
                while q and now[s] + hf[j] > caps[s]:
                    i, work, byte = q.popleft()
                    slots[s][i], c, now[s] = at, c + work, now[s] - byte
            while q and c + q[0][1] * keep <= ready:  # the gap: whole W's, oldest first, that end by the input
                i, work, byte = q.popleft()
                slots[s][i], c, now[s] = at, c + work, now[s] - byte
        if ready > c:
            idle[s] += ready - c
            if idle[s] > slack:
                over = True
                break
            c = ready
        c += f[j] if fwd else b[j]
        end[e] = c
        if fwd:
            now[s] += hf[j]
        else:
            now[s] += hw[j] - hf[j]
            q.append((ev.backward[e], w[j], hw[j]))
            while q and now[s] > caps[s]:
                i, work, byte = q.popleft()
                slots[s][i], c, now[s] = ev.place[e], c + work, now[s] - byte
        clock[s] = c
    for s in range(pp):
        for _, work, _ in pending[s]:  # one at a time, as `time_deferred` adds them
            clock[s] += work
    fused = time_deferred(forward_s, input_grad_s, weight_grad_s, pp, (), vp=vp, p2p_s=p2p_s)[0] if fused_s is None \
        else fused_s
    if over or max(clock) >= fused:
        return tuple(() for _ in range(pp)), fused
    return tuple(tuple(x) for x in slots), max(clock)


def time_deferred(
    forward_s: Sequence[float], input_grad_s: Sequence[float], weight_grad_s: Sequence[float], pp: int,
    slots: Slots, *, vp: int = 1, p2p_s: Sequence[float] | float = 0.0, keep_events: bool = False,
) -> tuple[float, np.ndarray | None, np.ndarray | None]:
    """The replica's time with each stage's W's after the events its `slots` name, each after that event's
    output is sent (an empty stage: the fused backward, sent after its W, `sim.simulate_replica`'s); with
    `keep_events`, the event rows (stage, micro-batch, kind: FORWARD, BACKWARD or WEIGHT, start, end) in the order
    they were timed, and each row's chunk."""
    m = len(forward_s)
    if m == 0:
        return 0.0, np.zeros((0, 5)) if keep_events else None, np.zeros(0, dtype=np.int64) if keep_events else None
    ev = _events(pp, vp, m)
    f, b, w = _chunks(forward_s, vp), _chunks(input_grad_s, vp), _chunks(weight_grad_s, vp)
    comm = np.broadcast_to(np.asarray(p2p_s, dtype=np.float64), (m,)).tolist()
    after: list[dict[int, list[int]]] = [{} for _ in range(pp)]  # stage -> place -> its W's (backward numbers)
    for s in range(pp):
        for i, p in enumerate(slots[s] if s < len(slots) else ()):
            after[s].setdefault(p, []).append(i)
    split = [bool(a) for a in after]
    clock, end, rows, chunks = [0.0] * pp, [0.0] * len(ev.stage), [], []
    for e, (s, fwd, j, d, sent) in enumerate(zip(ev.stage, ev.forward, ev.micro_batch, ev.dep, ev.transfer,
                                                 strict=True)):
        ready = 0.0 if d < 0 else end[d] + (comm[j] if sent else 0.0)
        start = clock[s] if clock[s] > ready else ready
        c = end[e] = start + (f[j] if fwd else b[j] if split[s] else b[j] + w[j])
        if keep_events:
            rows.append((s, j, FORWARD if fwd else BACKWARD, start, c))
            chunks.append(ev.chunk[e])
        for i in after[s].get(ev.place[e], ()):
            jw, cw = ev.backwards[s][i]
            if keep_events:
                rows.append((s, jw, WEIGHT, c, c + w[jw]))
                chunks.append(cw)
            c += w[jw]
        clock[s] = c
    if not keep_events:
        return max(clock), None, None
    return max(clock), np.array(rows, dtype=np.float64).reshape(-1, 5), np.array(chunks, dtype=np.int64)


def slot_errors(slots: Slots, pp: int, vp: int, m: int) -> str | None:
    """What is wrong with a replica's slots (None: valid): per stage none (fused) or one per backward,
    nondecreasing, each at or after its own backward and inside the stage's order."""
    if len(slots) not in (0, pp):
        return f"{len(slots)} stages of deferral for pp {pp}"
    if m == 0 and any(slots):
        return "slots for a replica without micro-batches"
    for s, own in enumerate(slots):
        if own and (error := slots_error(stage_order(pp, vp, m, s), own)) is not None:
            return f"stage {s}: {error}"
    return None


def split_backward(
    config: ParallelConfig, cost: CostModel, tokens: Sequence[int], times: Sequence[float]
) -> tuple[list[float], list[float], list[float]]:
    """Each micro-batch's forward, B and W seconds on one stage from its stage `times` (the simulator's,
    `sim.replica_stage_times`) and `tokens`. W is the weight gradients' GEMMs: half the backward's share of the
    plain per-token b term (b counts the layers' and the head's GEMMs); attention's a s^2 has no weights and c
    stays with B, as does the forward a memory policy runs again (it precedes B). A config of the run-wide
    recompute or selective set has that policy's scale in b already: W takes it out."""
    b = cost.coefficients(config).b
    run_wide = cost.policies(config)[0]
    if run_wide != MemoryPolicy.NONE:
        b /= derived_scales(cost.model)[run_wide][1]
    weight = [b * n * (1 - FORWARD_SHARE) / 2 for n in tokens]
    forward = [t * FORWARD_SHARE for t in times]
    return forward, [t * (1 - FORWARD_SHARE) - w for t, w in zip(times, weight, strict=True)], weight
