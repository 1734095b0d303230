"""Event-level pipeline simulator: executes an IterationPlan against the cost model.

Each stage runs its micro-batches in the non-interleaved 1F1B order (warm-up
forwards, steady one-forward-one-backward, cool-down backwards), or, for a
config with vp > 1 model chunks per rank, Megatron's interleaved 1F1B order
(`pipeline_order.interleaved_order`). A forward needs the previous (virtual) stage's forward
of the same micro-batch, a backward the next one's backward, each plus a p2p
transfer. Forward is 1/3 and backward 2/3 of the stage time t, a chunk 1/vp of
each. With m equal micro-batches and free transfers, this gives exactly
(m + pp - 1) * t, interleaved (m + (pp - 1) / vp) * t where m is a multiple of pp.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.conditions import SharedCores
from hydraulis.cost.model import CostModel
from hydraulis.parallel import ParallelConfig
from hydraulis.pipeline_order import FORWARD, depends_on, event_arrays, interleaved_order
from hydraulis.planner.oracles.deferral import split_backward, time_deferred
from hydraulis.planner.plan import IterationPlan

FORWARD_SHARE = 1.0 / 3.0

@dataclass(frozen=True)
class ReplicaTimeline:
    time_s: float
    stage_busy_s: np.ndarray  # [pp]
    # One row per event: stage, micro-batch, kind (0 forward, 1 backward), start, end.
    events: np.ndarray | None
    chunks: np.ndarray | None = None  # interleaved (vp > 1): each event's model chunk; None under plain 1F1B


def simulate_replica(
    stage_times: Sequence[float] | np.ndarray,
    pp: int,
    p2p_s: Sequence[float] | np.ndarray | float = 0.0,
    keep_events: bool = True,
    vp: int = 1,
) -> ReplicaTimeline:
    """Run 1F1B (interleaved with `vp` chunks per stage) on `pp` stages for micro-batches of the given stage
    times (in order); `p2p_s`, each micro-batch's one crossing of a stage boundary (vp pp - 1 of them each way)."""
    t = np.asarray(stage_times, dtype=np.float64)
    v = len(t)
    if v == 0:
        return ReplicaTimeline(0.0, np.zeros(pp), np.zeros((0, 5)) if keep_events else None)
    if pp == 1:
        return _single_stage(t, keep_events)
    comm = np.broadcast_to(np.asarray(p2p_s, dtype=np.float64), (v,))
    busy, key = np.full(pp, float(t.sum())), (pp, vp, t.tobytes(), comm.tobytes())
    if not keep_events and key in _FINISHED:
        return ReplicaTimeline(_FINISHED[key], busy, None)
    sweep = _sweep(pp, v, vp)
    end = run_events(sweep, *event_tables(t, comm, vp))
    assert end is not None
    time_s = max(end[e + 1] for e in sweep.last)
    if not keep_events:
        return ReplicaTimeline(time_s, busy, None)
    ends = np.array(end[1:] + end[:1])  # each start again, as the loop took it (index -1: none)
    begin = np.maximum(ends[sweep.prev], ends[sweep.dep] + np.where(sweep.transfer, comm[sweep.micro_batch], 0.0))
    rows = np.column_stack([sweep.stage, sweep.micro_batch, sweep.kind, begin, ends[:-1]]).astype(np.float64)
    return ReplicaTimeline(time_s, busy, rows, sweep.chunk if vp > 1 else None)


# The times of the packing search's last simulations run to their end (`order_search.time_below`), by (pp, vp,
# stage times, p2p times): the planner simulates its chosen packings again (`simulate`), and the search meets
# orders again (the splits' phases). Beside them the beats it gave up at (each order surely slower).
Key = tuple[int, int, bytes, bytes]
_FINISHED: dict[Key, float] = {}
_ABOVE: dict[Key, float] = {}
FINISHED_KEPT = 4096  # of each; the oldest forgotten past it


def finished(key: Key) -> float | None:
    """A finished simulation's time (`remember`), None where none is kept."""
    return _FINISHED.get(key)


def remember(key: Key, time_s: float) -> float:
    """Keep a finished simulation's time; return it."""
    return _keep(_FINISHED, key, time_s)


def given_up(key: Key) -> float:
    """The highest beat a simulation of `key` gave up at (`give_up`), -inf where none is kept."""
    return _ABOVE.get(key, -np.inf)


def give_up(key: Key, beat: float) -> None:
    """Keep that a simulation gave up at `beat` (its time surely above it)."""
    _keep(_ABOVE, key, max(beat, given_up(key)))


def forget() -> None:
    """Drop the kept simulations (a benchmark's repeat of a batch then plans it as afresh)."""
    _FINISHED.clear()
    _ABOVE.clear()


def _keep(kept: dict[Key, float], key: Key, value: float) -> float:
    if key not in kept and len(kept) >= FINISHED_KEPT:
        del kept[next(iter(kept))]
    kept[key] = value
    return value


def _single_stage(t: np.ndarray, keep_events: bool) -> ReplicaTimeline:
    """One stage has no dependencies: each micro-batch's forward then backward, back to back."""
    v = len(t)
    ends = np.cumsum(t)
    events = None
    if keep_events:
        starts = ends - t
        f_end = starts + t * FORWARD_SHARE
        events = np.zeros((2 * v, 5))
        events[0::2] = np.column_stack([np.zeros(v), np.arange(v), np.zeros(v), starts, f_end])
        events[1::2] = np.column_stack([np.zeros(v), np.arange(v), np.ones(v), f_end, ends])
    return ReplicaTimeline(float(ends[-1]), np.array([float(t.sum())]), events)


@dataclass(frozen=True)
class _Sweep:
    """The events of pp stages and v micro-batches (vp chunks each) in an order where each comes after what it
    waits for: per event its stage, micro-batch, kind and chunk, the previous event on its stage and the event
    it depends on (-1: none), and whether a p2p transfer lies between them. The same for every replica of that
    shape."""

    stage: np.ndarray
    micro_batch: np.ndarray
    kind: np.ndarray
    chunk: np.ndarray
    prev: np.ndarray
    dep: np.ndarray
    transfer: np.ndarray  # bool
    forward: np.ndarray  # bool
    last: list[int]  # each stage's last event
    by_stage: np.ndarray  # the events grouped by stage, each stage's in its order
    chain: np.ndarray  # [v, 2 vp pp]: each micro-batch's events, each waiting for the one before it
    after: list[int]  # per event, prev + 1: `run_events`'s slot of its stage's previous event
    on: list[int]  # per event, dep + 1: the slot of its input
    work_at: list[int]  # per event, its place in `event_tables`' work: micro-batch j's forward j, backward v + j
    comm_at: list[int]  # per event, its place in their p2p times: j, or v (0.0) where its input is on its stage


@functools.lru_cache(maxsize=256)
def _sweep(pp: int, v: int, vp: int = 1) -> _Sweep:
    """`pipeline_order.event_graph` as the simulator reads it: the order in which the events become computable
    (the simulator's historical order, kept for its event rows), with each micro-batch's chain of events (place
    p < P = pp vp: the forward of virtual stage p; place 2 P - 1 - p: its backward) and the inner loop's slots."""
    g = event_arrays(pp, vp, v)
    prev, dep, virtual = g.prev, g.dep, g.chunk * pp + g.stage
    forward, transfer = g.kind == FORWARD, (dep >= 0) & (g.stage[dep] != g.stage)
    chain = np.empty((v, 2 * pp * vp), dtype=np.int64)
    chain[g.micro_batch, np.where(forward, virtual, 2 * pp * vp - 1 - virtual)] = np.arange(len(prev))
    return _Sweep(stage=g.stage, micro_batch=g.micro_batch, kind=g.kind, chunk=g.chunk, prev=prev, dep=dep,
                  transfer=transfer, forward=forward, last=g.last.tolist(),
                  by_stage=np.argsort(g.stage, kind="stable"), chain=chain, after=(prev + 1).tolist(),
                  on=(dep + 1).tolist(), work_at=np.where(forward, g.micro_batch, v + g.micro_batch).tolist(),
                  comm_at=np.where(transfer, g.micro_batch, v).tolist())


def event_tables(t: np.ndarray, comm: np.ndarray, vp: int) -> tuple[list[float], list[float]]:
    """One order's tables for `run_events` (its events index them: `_Sweep.work_at`, `comm_at`): each
    micro-batch's forward and backward chunk (forwards first), and its p2p time, a last 0.0 for an input on
    the event's own stage. O(v) per order, where the events are 2 pp vp v."""
    return np.concatenate([t * FORWARD_SHARE / vp, t * (1.0 - FORWARD_SHARE) / vp]).tolist(), [*comm.tolist(), 0.0]


RUN: Counter[str] = Counter()  # simulations and events `run_events` ran in this process: the work, load aside


def run_events(
    sweep: _Sweep, work: list[float], comm: list[float], above: list[float] | None = None
) -> list[float] | None:
    """Each event's end in the sweep's order, after its stage's previous event and its input (plain lists: the
    inner loop; `event_tables`' work and p2p times), one slot first, 0.0, the end of none. None once an event ends
    after its `above`."""
    end = [0.0]
    push = end.append
    RUN["simulations"] += 1
    if above is None:
        for p, d, x, w in zip(sweep.after, sweep.on, sweep.comm_at, sweep.work_at, strict=True):
            start, ready = end[p], end[d] + comm[x]
            push((ready if ready > start else start) + work[w])
        RUN["events"] += len(end) - 1
        return end
    for p, d, x, w, h in zip(sweep.after, sweep.on, sweep.comm_at, sweep.work_at, above, strict=True):
        start, ready = end[p], end[d] + comm[x]
        finish = (ready if ready > start else start) + work[w]
        if finish > h:
            RUN["events"] += len(end)
            return None
        push(finish)
    RUN["events"] += len(end) - 1
    return end


def closed_form_replica_time(stage_times: Sequence[float] | np.ndarray, pp: int, vp: int = 1) -> float:
    """sum t + (pp - 1) / vp * max t: close to the simulation, exact for equal micro-batches (interleaved: for a
    count that is a multiple of pp)."""
    t = np.asarray(stage_times, dtype=np.float64)
    return float(t.sum() + (pp - 1) / vp * t.max()) if len(t) else 0.0


@dataclass(frozen=True)
class SimResult:
    iteration_time_s: float
    compute_time_s: float
    grad_sync_s: float
    replica_times_s: np.ndarray  # [replicas]
    gpu_busy_s: np.ndarray  # [num_gpus]
    gpu_idle_s: np.ndarray  # [num_gpus], within the compute phase
    timelines: tuple[ReplicaTimeline, ...]

    @property
    def bubble_fraction(self) -> float:
        total = self.compute_time_s * len(self.gpu_busy_s)
        return float(self.gpu_idle_s.sum() / total) if total > 0 else 0.0


def replica_stage_times(plan: IterationPlan, replica: int, cost: CostModel) -> tuple[list[float], list[float]]:
    """Stage time and p2p time of each micro-batch of one replica, in order, each under its memory policy."""
    config = plan.deployment.replicas[replica].config
    lengths = plan.micro_batch_lengths(replica)
    times = [cost.stage_time(config, s, plan.policy(replica, k)) for k, s in enumerate(lengths)]
    comm = [cost.p2p_time(config, int(s.sum())) for s in lengths]
    return times, comm


def work_bound(plan: IterationPlan, cost: CostModel) -> float:
    """A floor of the plan's simulated iteration in any order of its events, weight gradients deferred or not: a stage
    of its busiest replica runs every micro-batch's work one at a time, then the step (0 on shared CPU cores, whose
    rates follow what runs beside)."""
    if cost.shared_cores is not None:
        return 0.0
    work = max((sum(replica_stage_times(plan, r, cost)[0]) for r in range(len(plan.replicas))), default=0.0)
    return work + cost.step_time(plan.deployment.configs)


def replica_compute_s(plan: IterationPlan, cost: CostModel) -> list[float]:
    """Each replica's simulated compute: as `finalize` simulated it where the plan carries that (a deferred plan of
    thousands of sequences takes a while to simulate again; with the exchange inside compute those times hold it,
    so then simulated), else simulated."""
    if plan.replica_predicted_s and len(plan.replica_predicted_s) == len(plan.replicas) and not cost.overlap_exchange:
        return list(plan.replica_predicted_s)
    return [tl.time_s for tl in simulate(plan, cost, keep_events=False).timelines]


def simulate(plan: IterationPlan, cost: CostModel, keep_events: bool = True) -> SimResult:
    """The plan's iteration: every replica's 1F1B (interleaved where its config has vp > 1), then the step after
    compute.

    With `cost.overlap_exchange` (the trainer's, from `[parallel] overlap_exchange`) the exchange runs
    inside compute, so each busy replica's time, as the trainer measures it, holds its share of the step
    (CostModel.exchange_in_compute); the iteration is the same either way.
    """
    num_gpus = plan.deployment.num_gpus
    busy = np.zeros(num_gpus)
    shared = cost.shared_cores
    stage_times = [replica_stage_times(plan, r, cost) for r in range(len(plan.deployment.replicas))]
    if shared is not None:
        # On shared CPU cores the replicas run together: a waiting stage lends its core.
        timelines = shared_timelines(plan.deployment.configs, [t for t, _ in stage_times],
                                     [c for _, c in stage_times], shared, keep_events)
    else:
        timelines = [_replica_timeline(plan, r, cost, times, comm, keep_events=keep_events)
                     for r, (times, comm) in enumerate(stage_times)]
    for replica, timeline in zip(plan.deployment.replicas, timelines, strict=True):
        for s in range(replica.config.pp):
            busy[list(replica.stage_devices(s))] = timeline.stage_busy_s[s]
    replica_times = np.array([tl.time_s for tl in timelines])
    compute = float(replica_times.max()) if len(replica_times) else 0.0
    sync = cost.step_time(plan.deployment.configs)
    if cost.overlap_exchange:
        inside = [cost.exchange_in_compute(r.config, num_gpus) for r in plan.deployment.replicas]
        replica_times = replica_times + np.where(replica_times > 0, inside, 0.0)
    return SimResult(
        iteration_time_s=compute + sync,
        compute_time_s=compute,
        grad_sync_s=sync,
        replica_times_s=replica_times,
        gpu_busy_s=busy,
        gpu_idle_s=compute - busy,
        timelines=tuple(timelines),
    )


def _replica_timeline(plan: IterationPlan, replica: int, cost: CostModel, times: list[float], comm: list[float],
                      keep_events: bool) -> ReplicaTimeline:
    """One replica's (interleaved) 1F1B, or, where the plan defers its weight gradients (`ReplicaPlan.deferral`),
    that order with W events (`oracles.deferral.time_deferred`; shared CPU cores above run the fused order)."""
    config, slots = plan.deployment.replicas[replica].config, plan.replicas[replica].deferral
    if not slots:
        return simulate_replica(times, config.pp, comm, keep_events=keep_events, vp=config.vp)
    tokens = [int(s.sum()) for s in plan.micro_batch_lengths(replica)]
    forward, input_grad, weight = split_backward(config, cost, tokens, times)
    time_s, rows, chunks = time_deferred(forward, input_grad, weight, config.pp, slots, vp=config.vp, p2p_s=comm,
                                         keep_events=keep_events)
    return ReplicaTimeline(time_s, np.full(config.pp, float(np.sum(times))), rows,
                           chunks if keep_events and config.vp > 1 else None)


# -- replicas sharing CPU cores ------------------------------------------------------------------
# With more ranks than cores a rank's speed depends on how many ranks compute at that moment, and a
# pipeline stage waiting for its neighbour (1F1B's warm-up and cool-down, a p2p transfer) computes
# nothing, so it lends its core to the others. Scaling each replica by the ranks of the whole
# deployment counted those waits as work: on `2x(tp1,pp2)` over 2 cores it predicted 0.36 s where
# 0.28 s ran. So every replica's stages run in one simulation under processor sharing
# (cost.model.SharedCores): a task (forward or backward of one micro-batch on one stage) has `work`,
# its measured time divided by the slowdown it was measured under; while B ranks compute, each
# computing stage progresses at 1 / slowdown(B) of full speed, a stage of tp x cp ranks (a TP gang)
# counting all of them. Events are the ends of tasks and the arrivals of p2p transfers; between them
# every rate is constant.

_EPS = 1e-12


class _Lane:
    """One pipeline stage of one replica: its (interleaved) 1F1B tasks in order, and where it is in them."""

    def __init__(self, replica: int, stage: int, config: ParallelConfig, times: np.ndarray, scale: float) -> None:
        self.replica = replica
        self.stage = stage
        self.ranks = config.tp * config.cp
        self.order = interleaved_order(config.pp, config.vp, len(times), stage)
        self.work = [scale * times[j] * (FORWARD_SHARE if kind == FORWARD else 1 - FORWARD_SHARE) / config.vp
                     for kind, j, _ in self.order]
        self.next = 0
        self.remaining = -1.0  # work left of the running task; negative: none running
        self.started = 0.0
        self.busy = 0.0  # seconds it computed
        self.finished = 0.0  # when its last task ended

    @property
    def done(self) -> bool:
        return self.next == len(self.order)


def shared_timelines(
    configs: Sequence[ParallelConfig],
    stage_times: Sequence[Sequence[float]],
    comm: Sequence[Sequence[float]],
    shared: SharedCores,
    keep_events: bool = True,
) -> list[ReplicaTimeline]:
    """Every replica's 1F1B timeline when all of them start together on the shared cores."""
    lanes: list[_Lane] = []
    for r, (config, times) in enumerate(zip(configs, stage_times, strict=True)):
        t = np.asarray(times, dtype=np.float64)
        base = config.base
        scale = 1.0 / shared.slowdown(base, shared.busy_ranks[base]) if base in shared.busy_ranks else 1.0
        if len(t):
            lanes += [_Lane(r, s, config, t, scale) for s in range(config.pp)]
    ends: dict[tuple[int, int, int, int, int], float] = {}  # (replica, stage, kind, chunk, micro-batch) -> end
    rows: list[list[tuple[int, int, int, float, float]]] = [[] for _ in configs]
    now = 0.0
    while True:
        arrivals = [_ready(lane, ends, configs, comm) for lane in lanes if not lane.done and lane.remaining < 0]
        for lane in lanes:
            if not lane.done and lane.remaining < 0 and _ready(lane, ends, configs, comm) <= now + _EPS:
                lane.remaining = lane.work[lane.next]
                lane.started = now
        running = [lane for lane in lanes if lane.remaining >= 0]
        if not running:
            if all(lane.done for lane in lanes):
                break
            now = min(a for a in arrivals if a > now)  # every stage waits for a transfer
            continue
        busy = sum(lane.ranks for lane in running)
        rates = [_rate(shared, configs[lane.replica], busy) for lane in running]
        step = min(lane.remaining / rate for lane, rate in zip(running, rates, strict=True))
        waiting = [a for a in arrivals if now + _EPS < a < now + step]
        step = min([step, *(a - now for a in waiting)])
        now += step
        for lane, rate in zip(running, rates, strict=True):
            lane.remaining -= step * rate
            if lane.remaining <= _EPS * max(1.0, lane.work[lane.next]):
                kind, j, chunk = lane.order[lane.next]
                ends[(lane.replica, lane.stage, kind, chunk, j)] = now
                lane.busy += now - lane.started
                lane.finished = now
                if keep_events:
                    rows[lane.replica].append((lane.stage, j, kind, lane.started, now))
                lane.next += 1
                lane.remaining = -1.0
    return [_timeline(config, [lane for lane in lanes if lane.replica == r], rows[r], keep_events)
            for r, config in enumerate(configs)]


def _ready(lane: _Lane, ends: dict, configs: Sequence[ParallelConfig], comm: Sequence[Sequence[float]]) -> float:
    """When the lane's next task may start: its dependency's end plus the transfer; inf while it has not ended."""
    kind, j, chunk = lane.order[lane.next]
    config = configs[lane.replica]
    on = depends_on(config.pp, config.vp, lane.stage, kind, chunk)
    if on is None:
        return 0.0
    dep = ends.get((lane.replica, *on, j))
    if on[0] == lane.stage:  # the last virtual stage's backward after its own forward: no transfer
        return np.inf if dep is None else dep
    return np.inf if dep is None else dep + comm[lane.replica][j]


def _rate(shared: SharedCores, config: ParallelConfig, busy: int) -> float:
    """Work per second of a stage of `config` while `busy` ranks compute (1 for a config measured unshared)."""
    return 1.0 / shared.slowdown(config, busy) if config.base in shared.busy_ranks else 1.0


def _timeline(config: ParallelConfig, lanes: list[_Lane], rows: list, keep_events: bool) -> ReplicaTimeline:
    busy = np.zeros(config.pp)
    for lane in lanes:
        busy[lane.stage] = lane.busy
    end = max((lane.finished for lane in lanes), default=0.0)
    events = np.array(rows, dtype=np.float64).reshape(-1, 5) if keep_events else None
    return ReplicaTimeline(float(end), busy, events)
