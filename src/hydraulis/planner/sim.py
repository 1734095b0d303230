"""Event-level 1F1B simulator: executes an IterationPlan against the cost model.

Each stage runs its micro-batches in the non-interleaved 1F1B order (warm-up
forwards, steady one-forward-one-backward, cool-down backwards). A forward
needs the previous stage's forward of the same micro-batch, a backward the
next stage's backward, each plus a p2p transfer. Forward is 1/3 and backward
2/3 of the stage time t. With equal micro-batches and free transfers, this
gives exactly (v + pp - 1) * t.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.planner.plan import IterationPlan

FORWARD_SHARE = 1.0 / 3.0

# Event kinds in timelines.
FORWARD, BACKWARD = 0, 1


def one_f_one_b_order(pp: int, v: int, stage: int) -> list[tuple[int, int]]:
    """(kind, micro-batch) in the order stage `stage` runs them."""
    warmup = min(pp - 1 - stage, v)
    order = [(FORWARD, j) for j in range(warmup)]
    for j in range(v - warmup):
        order.append((FORWARD, warmup + j))
        order.append((BACKWARD, j))
    order += [(BACKWARD, j) for j in range(v - warmup, v)]
    return order


@dataclass(frozen=True)
class ReplicaTimeline:
    time_s: float
    stage_busy_s: np.ndarray  # [pp]
    # One row per event: stage, micro-batch, kind (0 forward, 1 backward), start, end.
    events: np.ndarray | None


def simulate_replica(
    stage_times: Sequence[float] | np.ndarray,
    pp: int,
    p2p_s: Sequence[float] | np.ndarray | float = 0.0,
    keep_events: bool = True,
) -> ReplicaTimeline:
    """Run 1F1B on `pp` stages for micro-batches of the given stage times (in order)."""
    t = np.asarray(stage_times, dtype=np.float64)
    v = len(t)
    if v == 0:
        return ReplicaTimeline(0.0, np.zeros(pp), np.zeros((0, 5)) if keep_events else None)
    comm = np.broadcast_to(np.asarray(p2p_s, dtype=np.float64), (v,)).tolist()
    fwd = (t * FORWARD_SHARE).tolist()
    bwd = (t * (1.0 - FORWARD_SHARE)).tolist()
    if pp == 1:
        ends = np.cumsum(t)
        events = None
        if keep_events:
            starts = ends - t
            f_end = starts + np.asarray(fwd)
            events = np.zeros((2 * v, 5))
            events[0::2] = np.column_stack([np.zeros(v), np.arange(v), np.zeros(v), starts, f_end])
            events[1::2] = np.column_stack([np.zeros(v), np.arange(v), np.ones(v), f_end, ends])
        return ReplicaTimeline(float(ends[-1]), np.array([float(t.sum())]), events)

    orders = [one_f_one_b_order(pp, v, s) for s in range(pp)]
    f_end = [[-1.0] * v for _ in range(pp)]
    b_end = [[-1.0] * v for _ in range(pp)]
    free = [0.0] * pp
    ptr = [0] * pp
    rows: list[tuple[int, int, int, float, float]] = []
    remaining = 2 * v * pp
    last = pp - 1
    while remaining:
        progressed = False
        for s in range(pp):
            order = orders[s]
            k = ptr[s]
            while k < len(order):
                kind, j = order[k]
                if kind == FORWARD:
                    if s == 0:
                        ready = 0.0
                    else:
                        dep = f_end[s - 1][j]
                        if dep < 0:
                            break
                        ready = dep + comm[j]
                    start = max(free[s], ready)
                    end = start + fwd[j]
                    f_end[s][j] = end
                else:
                    if s == last:
                        ready = f_end[s][j]
                    else:
                        dep = b_end[s + 1][j]
                        if dep < 0:
                            break
                        ready = dep + comm[j]
                    start = max(free[s], ready)
                    end = start + bwd[j]
                    b_end[s][j] = end
                free[s] = end
                if keep_events:
                    rows.append((s, j, kind, start, end))
                k += 1
                remaining -= 1
                progressed = True
            ptr[s] = k
        if not progressed:  # pragma: no cover - the 1F1B order is deadlock-free
            raise RuntimeError("1F1B simulation deadlocked")
    busy = np.full(pp, float(t.sum()))
    return ReplicaTimeline(max(free), busy, np.array(rows) if keep_events else None)


def closed_form_replica_time(stage_times: Sequence[float] | np.ndarray, pp: int) -> float:
    """sum t + (pp - 1) * max t: close to the simulation, exact for equal micro-batches."""
    t = np.asarray(stage_times, dtype=np.float64)
    return float(t.sum() + (pp - 1) * t.max()) if len(t) else 0.0


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
    """Stage time and p2p time of each micro-batch of one replica, in order."""
    config = plan.deployment.replicas[replica].config
    lengths = plan.micro_batch_lengths(replica)
    times = [cost.stage_time(config, s) for s in lengths]
    comm = [cost.p2p_time(config, int(s.sum())) for s in lengths]
    return times, comm


def simulate(plan: IterationPlan, cost: CostModel, keep_events: bool = True) -> SimResult:
    num_gpus = plan.deployment.num_gpus
    timelines = []
    busy = np.zeros(num_gpus)
    shared = cost.shared_cores
    stage_times = [replica_stage_times(plan, r, cost) for r in range(len(plan.deployment.replicas))]
    if shared is not None:
        # On shared CPU cores only replicas with work compete, and each speeds up as others finish.
        lines = [simulate_replica(t, d.config.pp, c, keep_events=False)
                 for (t, c), d in zip(stage_times, plan.deployment.replicas, strict=True)]
        alone = [tl.time_s for tl in lines]
        # A pipelined replica's ranks compute only outside its bubbles (a lone micro-batch: one stage at a time).
        ranks = [d.config.tp * d.config.cp * tl.stage_busy_s.sum() / tl.time_s if tl.time_s > 0 else d.config.num_gpus
                 for tl, d in zip(lines, plan.deployment.replicas, strict=True)]
        finish = shared.finish_times(plan.deployment.configs, np.array(alone), np.array(ranks))
        stage_times = [
            ([x * f / a for x in t] if a > 0 else t, c)
            for (t, c), a, f in zip(stage_times, alone, finish, strict=True)
        ]
    for replica, (times, comm) in zip(plan.deployment.replicas, stage_times, strict=True):
        timeline = simulate_replica(times, replica.config.pp, comm, keep_events=keep_events)
        timelines.append(timeline)
        for s in range(replica.config.pp):
            busy[list(replica.stage_devices(s))] = timeline.stage_busy_s[s]
    replica_times = np.array([tl.time_s for tl in timelines])
    compute = float(replica_times.max()) if len(replica_times) else 0.0
    sync = cost.step_time(plan.deployment.configs)
    return SimResult(
        iteration_time_s=compute + sync,
        compute_time_s=compute,
        grad_sync_s=sync,
        replica_times_s=replica_times,
        gpu_busy_s=busy,
        gpu_idle_s=compute - busy,
        timelines=tuple(timelines),
    )
