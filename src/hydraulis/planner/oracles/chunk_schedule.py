"""Chunked long sequences as a schedule (issue 50, item 4): the real order of one sequence's chunks on a
replica's pipeline, and what plans would gain if they ran the longest sequences so on the bulk replicas.

`cost/chunks.py`'s oracle sizes the chunks (the largest C with C + kappa s within the lone cap: the whole
sequence's K/V and its gradient, every chunk's stage inputs) and charges their work, recompute and c, but
takes the pipeline's bubbles as filled. Here they run: on each rank, in its own pass after the replica's
micro-batches, the forwards of chunks 0..k-1 through every (virtual) stage (chunk i after chunk i - 1 on a
stage: it attends to the K/V its predecessors left there; a forward keeps only the K/V and the stage's
input, the last chunk's its activations), then the backwards in reverse, chunk i after chunk i + 1 on a
stage (the gradient of chunk i's K/V accumulates from every later chunk), each chunk but the last
preceded on the stage by its forward again (the recompute: its stage input and its predecessors' K/V are
held), so a rank holds one chunk's activations at most. Each rank runs its events in diagonal order
(forward of chunk i on virtual stage v by i + v, backward by (k - 1 - i) + (V - 1 - v)), an order every
dependency respects, so one pass in it times them all. With pp = 1 the chunks are serial on one stage and
the time is the oracle's; with k = 1 it is the simulator's lone micro-batch.

`plan_chunked` is the variant the oracle's gain asked for: a set of the batch's long sequences is taken
out, the rest planned by the planner as it is (phases and all), and each taken sequence, longest first,
run in chunks on the replica of the rest's schedule where the schedule's time grows least, its pass after
that replica's micro-batches (later phases' replicas hold the reduced gradient too: their cost model is
`CostModel.later_phase`'s). The best set, or none, wins. Simulator only: the runtime runs no chunks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.chunks import CHUNK_GRANULARITY, chunk_room, lone_cap
from hydraulis.cost.model import FORWARD_SHARE, CostModel
from hydraulis.cost.policies import MemoryPolicy
from hydraulis.errors import HydraulisError
from hydraulis.parallel import ParallelConfig
from hydraulis.planner.plan import Schedule
from hydraulis.planner.sim import replica_stage_times, simulate, simulate_replica

FORWARD, RECOMPUTE, BACKWARD = 0, 1, 2
MAX_HALVINGS = 4  # a pass also tries its largest chunk's halves, down to 1/16 (`chunk_run`)


@dataclass(frozen=True)
class ChunkRun:
    """One sequence in k chunks on one config: each chunk's stage seconds (forward + backward, c included)
    and its stage-boundary transfer."""

    config: ParallelConfig
    length: int
    chunk: int  # C: the last chunk's tokens and every one's but the first
    work_s: np.ndarray  # [k]
    p2p_s: np.ndarray  # [k]
    policy: MemoryPolicy  # every chunk's memory policy

    @property
    def k(self) -> int:
        return len(self.work_s)

    @property
    def stage_s(self) -> float:
        """One stage's busy seconds: every chunk's work, and every chunk's but the last forward again."""
        return float(self.work_s.sum() + FORWARD_SHARE * self.work_s[:-1].sum())


def chunk_bounds(length: int, chunk: int) -> np.ndarray:
    """The k + 1 token boundaries of a sequence in chunks of `chunk`, the first taking the remainder."""
    k = -(-length // chunk)
    return np.concatenate([[0], length - chunk * np.arange(k - 1, -1, -1)]).astype(np.int64)


def chunk_run(cost: CostModel, config: ParallelConfig, num_gpus: int, length: int) -> ChunkRun | None:
    """`length` tokens' pass of least time alone on `config`, over the memory policies it may run and, for
    each, the sequence whole where it fits the lone cap, the largest chunk that fits beside its K/V
    (`cost.chunks.chunk_room`) and that chunk's halves down to the busy threshold (more chunks, shorter fill
    and drain); None where neither the whole nor a busy chunk fits under any policy."""
    busy = max(cost.min_efficient_tokens(config), CHUNK_GRANULARITY)
    best, best_s = None, np.inf
    for policy in cost.policies(config):
        sizes = [length] if length <= lone_cap(cost, config, num_gpus, policy) else []
        room = int(chunk_room(cost, [config], num_gpus, np.array([length]), policy)[0, 0])
        k = -(-length // max(room, 1))
        for halving in range(MAX_HALVINGS + 1):
            size = -(-length // (k << halving))  # ceil, then up to the granularity
            sizes.append(min(room, -(-size // CHUNK_GRANULARITY) * CHUNK_GRANULARITY))
        for chunk in dict.fromkeys(c for c in sizes if c == length or busy <= c < length):
            run = in_chunks(cost, config, length, chunk, policy)
            if (t := chunk_time(run)) < best_s:
                best, best_s = run, t
    return best


def in_chunks(cost: CostModel, config: ParallelConfig, length: int, chunk: int, policy: MemoryPolicy) -> ChunkRun:
    """`length` tokens in chunks of `chunk` under `policy`: each chunk's stage seconds and transfer."""
    bounds = chunk_bounds(length, chunk).astype(np.float64)
    coef = cost.coefficients(config)
    sa, sb = cost.policy_scale(config, policy)
    work = sa * coef.a * np.diff(bounds * bounds) + sb * coef.b * np.diff(bounds) + coef.c
    p2p = np.array([cost.p2p_time(config, int(n)) for n in np.diff(bounds)])
    return ChunkRun(config=config, length=length, chunk=chunk, work_s=work, p2p_s=p2p, policy=policy)


@functools.lru_cache(maxsize=256)
def chunk_order(k: int, stages: int) -> tuple[tuple[int, int, int], ...]:
    """(kind, chunk, virtual stage) of every event in an order each rank runs its own in and every dependency
    respects (module docstring): forwards by i + v, then per backward diagonal each recompute before its
    backward."""
    forwards = sorted(((FORWARD, i, v) for i in range(k) for v in range(stages)), key=lambda e: (e[1] + e[2], e[2]))
    backwards = []
    for i, v in sorted(((i, v) for i in range(k) for v in range(stages)),
                       key=lambda x: ((k - 1 - x[0]) + (stages - 1 - x[1]), -x[1])):
        if i < k - 1:
            backwards.append((RECOMPUTE, i, v))
        backwards.append((BACKWARD, i, v))
    return tuple(forwards + backwards)


def chunk_pass(run: ChunkRun, free_s: Sequence[float] | np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each rank's end of the chunks' pass, every rank starting it once free (`free_s`; default 0), and each
    rank's busy seconds in it."""
    pp, vp = run.config.pp, run.config.vp
    stages = pp * vp
    rank_free = np.zeros(pp) if free_s is None else np.array(free_s, dtype=np.float64)
    busy = np.zeros(pp)
    share = {FORWARD: FORWARD_SHARE / vp, RECOMPUTE: FORWARD_SHARE / vp, BACKWARD: (1 - FORWARD_SHARE) / vp}
    end: dict[tuple[int, int, int], float] = {}
    for kind, i, v in chunk_order(run.k, stages):
        rank = v % pp
        ready = 0.0
        if kind == FORWARD and v > 0:
            ready = end[(FORWARD, i, v - 1)] + (run.p2p_s[i] if (v - 1) % pp != rank else 0.0)
        elif kind == BACKWARD and v < stages - 1:
            ready = end[(BACKWARD, i, v + 1)] + (run.p2p_s[i] if (v + 1) % pp != rank else 0.0)
        duration = share[kind] * run.work_s[i]
        end[(kind, i, v)] = rank_free[rank] = max(rank_free[rank], ready) + duration
        busy[rank] += duration
    return rank_free, busy


def chunk_time(run: ChunkRun) -> float:
    """The chunks' pass alone on an idle replica."""
    return float(chunk_pass(run)[0].max())


@dataclass(frozen=True)
class Placed:
    """A chunked sequence's place: its batch position, the phase and replica whose pass runs it, its run."""

    position: int
    phase: int
    replica: int
    run: ChunkRun


@dataclass(frozen=True)
class ChunkedSchedule:
    """The rest's schedule, the batch positions it runs, and the chunked sequences placed on its replicas."""

    schedule: Schedule
    rest: tuple[int, ...]  # the schedule's sequence q is the batch's rest[q]
    placed: tuple[Placed, ...]
    iteration_time_s: float


class _Replicas:
    """Every replica of a schedule's phases: when each rank is free after its micro-batches and the chunked
    passes placed on it so far, and each phase's compute (the slowest replica)."""

    def __init__(self, schedule: Schedule, cost: CostModel) -> None:
        if cost.shared_cores is not None:
            raise HydraulisError("chunked passes are timed on dedicated GPUs: the cost model shares CPU cores")
        self.phases = schedule.phases
        self.costs = [cost if p == 0 else cost.later_phase() for p in range(len(self.phases))]
        self.free: list[list[np.ndarray]] = []
        for plan in self.phases:
            rows = []
            for r, replica in enumerate(plan.deployment.replicas):
                times, comm = replica_stage_times(plan, r, cost)
                rows.append(_stage_ends(times, comm, replica.config))
            self.free.append(rows)
        self.compute = [float(simulate(plan, cost, keep_events=False).compute_time_s) for plan in self.phases]

    def best(self, length: int, num_gpus: int) -> tuple[float, float, int, int, ChunkRun] | None:
        """The cheapest place for a chunked sequence: (growth of its phase's compute, its replica's end, phase,
        replica, run); None where no replica's config runs it in chunks."""
        best = None
        for p, plan in enumerate(self.phases):
            runs = {g: chunk_run(self.costs[p], g, num_gpus, length) for g in set(plan.deployment.configs)}
            for r, config in enumerate(plan.deployment.configs):
                if (run := runs[config]) is None:
                    continue
                end = float(chunk_pass(run, self.free[p][r])[0].max())
                key = (max(end - self.compute[p], 0.0), end, p, r, run)
                if best is None or key[:2] < best[:2]:
                    best = key
        return best

    def place(self, phase: int, replica: int, run: ChunkRun) -> None:
        """Run `run`'s pass on the replica after what it runs so far."""
        self.free[phase][replica], _ = chunk_pass(run, self.free[phase][replica])
        self.compute[phase] = max(self.compute[phase], float(self.free[phase][replica].max()))

    def iteration_time_s(self, schedule: Schedule, cost: CostModel) -> float:
        """`schedule.phases_time` with these computes: each phase's, a switch between phases, the last step."""
        switches = schedule.switch_s * (len(self.phases) - 1)
        return sum(self.compute) + switches + cost.step_time(self.phases[-1].deployment.configs)


def _stage_ends(times: list[float], comm: list[float], config: ParallelConfig) -> np.ndarray:
    """When each rank of a replica finishes its micro-batches (the simulator's 1F1B)."""
    timeline = simulate_replica(times, config.pp, comm, keep_events=True, vp=config.vp)
    ends = np.zeros(config.pp)
    if timeline.events is not None and len(timeline.events):
        np.maximum.at(ends, timeline.events[:, 0].astype(np.int64), timeline.events[:, 4])
    return ends


def place_chunked(schedule: Schedule, cost: CostModel, num_gpus: int, lengths: np.ndarray,
                  positions: Sequence[int]) -> tuple[tuple[Placed, ...], float] | None:
    """The batch's sequences at `positions` (of `lengths`) run chunked on the schedule's replicas, longest
    first, each where the schedule's time grows least: their places and the iteration's time; None where
    some sequence has no replica that runs it in chunks."""
    replicas = _Replicas(schedule, cost)
    placed = []
    for pos in sorted(positions, key=lambda q: -int(lengths[q])):
        best = replicas.best(int(lengths[pos]), num_gpus)
        if best is None:
            return None
        _, _, phase, replica, run = best
        replicas.place(phase, replica, run)
        placed.append(Placed(position=int(pos), phase=phase, replica=replica, run=run))
    return tuple(placed), replicas.iteration_time_s(schedule, cost)


def plan_chunked(plan: Callable[[np.ndarray], Schedule], cost: CostModel, num_gpus: int, lengths: np.ndarray,
                 candidates: Sequence[Sequence[int]], configs: Sequence[ParallelConfig],
                 beat: float = np.inf) -> ChunkedSchedule | None:
    """The fastest schedule below `beat` over the `candidates` (sets of batch positions): a set's sequences run
    chunked (`place_chunked`), the rest as `plan` schedules them (the policy's own planning); None where none
    is. A set whose longest pass alone on the best of `configs` (the pool's; the first phase's memory, so a
    bound) is not below `beat` is dropped unplanned: no iteration is shorter than one of its passes."""
    lengths = np.asarray(lengths, dtype=np.int64)
    best = None
    for chosen in candidates:
        chunked = np.asarray(sorted(set(chosen)), dtype=np.int64)
        if len(chunked) == 0 or len(chunked) == len(lengths):
            continue
        target = beat if best is None else min(beat, best.iteration_time_s)
        if fastest_pass(cost, configs, num_gpus, int(lengths[chunked].max())) >= target:
            continue
        rest = np.setdiff1d(np.arange(len(lengths)), chunked)
        try:
            schedule = plan(lengths[rest])
        except HydraulisError:  # the rest has no plan on the pool
            continue
        out = place_chunked(schedule, cost, num_gpus, lengths[np.concatenate([rest, chunked])],
                            range(len(rest), len(lengths)))
        if out is not None and out[1] < target:
            order = np.concatenate([rest, chunked])
            placed = tuple(Placed(int(order[q.position]), q.phase, q.replica, q.run) for q in out[0])
            best = ChunkedSchedule(schedule=schedule, rest=tuple(int(q) for q in rest), placed=placed,
                                   iteration_time_s=out[1])
    return best


def fastest_pass(cost: CostModel, configs: Sequence[ParallelConfig], num_gpus: int, length: int) -> float:
    """The least time of `length` tokens' chunked pass alone on any of `configs` (inf: none runs it)."""
    runs = (chunk_run(cost, g, num_gpus, length) for g in dict.fromkeys(configs))
    return min((chunk_time(r) for r in runs if r is not None), default=np.inf)
