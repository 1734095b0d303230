"""A packing's fastest execution order (`packing.fastest_packing`): its candidate orders simulated from the lowest
floor up, each simulation given up once it cannot beat the best found, both by one relaxation of the pipeline.

A micro-batch alone, its chain of events (forwards down the virtual stages, backwards up) with nothing else
running, gives each event a least start (its head) and a least time still to come after it ends (its tail). A
stage runs its events in a fixed order, so a stage alone, each event released at its head, ends each no earlier
than one scan puts it (a max-plus prefix, numpy over every order of a micro-batch count at once). Hence:
- an order's floor: the most, over stages and events, of that end plus the event's tail;
- after an event ends, the iteration still takes its own tail, and the stage's later work up to any later event
  plus that one's tail: a simulation stops as soon as an event's end and this pass `beat` (`time_below`).
On long-70b-256g's interleaved replicas the floor skips about half the simulations the last micro-batch's
drain-only floor ran, and the later ones stop sooner (docs/results.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.planner.sim import (
    FORWARD_SHARE,
    _Sweep,
    _sweep,
    event_tables,
    finished,
    give_up,
    given_up,
    remember,
    run_events,
)

FLOOR_MARGIN = 1e-9  # relative: a bound's float sums may round above a time they meet exactly


@dataclass(frozen=True)
class _Events:
    """Some stages' events, each stage's in its order: each one's micro-batch, whether it is a forward, and its head
    and tail in its micro-batch's forward (f), backward (b) and p2p (c) times. A forward at place p of the chain
    (P = pp vp virtual stages) starts after p f and p transfers; the backward r places up from the last virtual
    stage after P f, r b and P - 1 + r transfers (that stage's backward follows its own forward); a chain ends
    after P f, P b and 2 P - 2 transfers."""

    stages: int
    micro_batch: np.ndarray
    forward: np.ndarray
    head: np.ndarray  # [3, events]: the coefficients of f, b, c
    tail: np.ndarray  # [3, events]

    @classmethod
    def of(cls, sweep: _Sweep, vp: int, stages: list[int]) -> _Events:
        P, per_stage = len(sweep.chain[0]) // 2, len(sweep.stage) // len(sweep.last)
        events = sweep.by_stage.reshape(-1, per_stage)[stages].ravel()
        place = np.empty(len(sweep.stage), dtype=np.int64)
        place[sweep.chain] = np.arange(2 * P)
        p, forward = place[events].astype(np.float64), sweep.forward[events]
        r, none = np.where(forward, 0.0, p - P), np.zeros(len(p))
        head = np.where(forward, [p, none, p], [none + P, r, P - 1 + r])
        tail = np.where(forward, [P - 1 - p, none + P, 2 * P - 2 - p], [none, P - 1 - r, P - 1 - r])
        return cls(len(stages), sweep.micro_batch[events], forward, head, tail)

    def bounds(self, times: np.ndarray, comm: np.ndarray, vp: int) -> tuple[np.ndarray, ...]:
        """[orders, stages, their events]: each event's work, its stage's work up to and with it, its head and its
        tail, for orders of stage and p2p times `times`, `comm` ([orders, micro-batches])."""
        j = self.micro_batch
        f, b, c = (np.take(x, j, axis=1) for x in (times * FORWARD_SHARE / vp, times * (1.0 - FORWARD_SHARE) / vp,
                                                   comm))
        shape = (len(times), self.stages, -1)
        work = np.where(self.forward, f, b).reshape(shape)
        head, tail = (f * k[0] + b * k[1] + c * k[2] for k in (self.head, self.tail))
        return work, np.cumsum(work, axis=2), head.reshape(shape), tail.reshape(shape)


@dataclass(frozen=True)
class _Layout:
    sweep: _Sweep
    vp: int
    every: _Events  # every stage's
    edges: _Events  # the first and the last stage's: the floor (the middle ones' bound no order more, measured)


@functools.lru_cache(maxsize=1024)  # long-70b-256g's proposal meets 755 (pp, v, vp): 256 rebuilt 2,897 times
def _layout(pp: int, v: int, vp: int) -> _Layout:
    sweep = _sweep(pp, v, vp)
    return _Layout(sweep, vp, _Events.of(sweep, vp, list(range(pp))), _Events.of(sweep, vp, [0, pp - 1]))


@dataclass(frozen=True)
class Orders:
    """Orders of one micro-batch count on one pipeline shape, ready to simulate one by one: their stage and p2p
    times ([orders, micro-batches]) and floors."""

    layout: _Layout
    times: np.ndarray
    comm: np.ndarray
    floor: np.ndarray  # [orders]


def prepare(times: np.ndarray, comm: np.ndarray, pp: int, vp: int) -> Orders:
    """`times` and `comm` ([orders, micro-batches]): each row the stage and p2p times of micro-batches in an order
    (pp > 1)."""
    layout = _layout(pp, times.shape[1], vp)
    work, done, head, tail = layout.edges.bounds(times, comm, vp)
    alone = done + np.maximum.accumulate(head - (done - work), axis=2)
    return Orders(layout, times, comm, (alone + tail).max(axis=(1, 2)) * (1.0 - FLOOR_MARGIN))


def after_each(orders: Orders, row: int) -> np.ndarray:
    """By stage (`_Sweep.by_stage`), the least time the iteration takes after each event of an order ends: the
    event's tail, or the stage's work up to a later event and that one's tail."""
    _, done, _, tail = orders.layout.every.bounds(orders.times[row : row + 1], orders.comm[row : row + 1],
                                                  orders.layout.vp)
    return (np.maximum.accumulate((done + tail)[:, :, ::-1], axis=2)[:, :, ::-1] - done).ravel()


def time_below(orders: Orders, row: int, beat: float = np.inf) -> float:
    """The simulated time of one order (as `sim.simulate_replica` gives it), or inf once it is surely above
    `beat`. The search meets the same order again (the splits' phases, a count's second round): a finished
    simulation within `beat` gives its time, one given up at a beat at or above this one inf, as simulating
    again would."""
    sweep = orders.layout.sweep
    key = (len(sweep.last), orders.layout.vp, orders.times[row].tobytes(), orders.comm[row].tobytes())
    done = finished(key)
    if done is not None and done <= beat:
        return done
    if given_up(key) >= beat:
        return np.inf
    above = None
    if beat < np.inf:
        above = np.empty(len(sweep.after))
        above[sweep.by_stage] = beat + FLOOR_MARGIN * abs(beat) - after_each(orders, row)
        above = above.tolist()
    end = run_events(sweep, *event_tables(orders.times[row], orders.comm[row], orders.layout.vp), above)
    if end is None:  # an event ended past its limit at `beat`: so it would at any lower beat
        give_up(key, beat)
        return np.inf
    return remember(key, max(end[e + 1] for e in sweep.last))


def replica_time_below(stage_times: np.ndarray, pp: int, p2p_s: np.ndarray, vp: int = 1, beat: float = np.inf) -> float:
    """`time_below` of one order (pp > 1)."""
    t, comm = (np.asarray(x, dtype=np.float64)[None] for x in (stage_times, p2p_s))
    return time_below(prepare(t, np.broadcast_to(comm, t.shape), pp, vp), 0, beat)


Candidate = tuple[np.ndarray, np.ndarray, Sequence[np.ndarray]]  # stage times, p2p times, orders (positions)


def fastest_order(candidates: Sequence[Candidate], pp: int, vp: int, beat: float = np.inf) -> tuple[float, int, int]:
    """(time, candidate, order): the least simulated time (pp > 1) over the candidates in each of their orders, of
    equal times the first candidate's first order, as simulating each in turn would choose; where none is below
    `beat`, a time not below it (inf, or its own). Orders are taken from the lowest floor up; one whose floor
    cannot beat the best found is never simulated."""
    counts: dict[int, list[tuple[int, int]]] = {}  # the orders of each micro-batch count, prepared together
    for k, (_, _, orders) in enumerate(candidates):
        for o, order in enumerate(orders):
            counts.setdefault(len(order), []).append((k, o))
    rows, prepared, keys = [], {}, {}
    for v, members in counts.items():
        t = np.stack([candidates[k][0][candidates[k][2][o]] for k, o in members])
        comm = np.stack([candidates[k][1][candidates[k][2][o]] for k, o in members])
        prepared[v], keys[v] = prepare(t, comm, pp, vp), np.concatenate([t, comm], axis=1)
        floors = prepared[v].floor.tolist()
        rows += [(f, k, o, v, i) for i, ((k, o), f) in enumerate(zip(members, floors, strict=True))]
    best: tuple[float, int, int] | None = None
    seen: dict[bytes, float] = {}  # packings often repeat another's times: simulated once
    for floor, k, o, v, i in sorted(rows):
        if best is not None and (floor, k, o) > best:
            break  # sorted by floor: no later one beats the best either
        key = keys[v][i].tobytes()
        if key not in seen:  # inf where it surely loses to the best found (the best only falls)
            seen[key] = time_below(prepared[v], i, beat if best is None else min(beat, best[0]))
        if best is None or (seen[key], k, o) < best:
            best = (seen[key], k, o)
    assert best is not None
    return best
