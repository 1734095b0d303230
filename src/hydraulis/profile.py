"""Measure the runtime on this machine, fit the cost model to it, and show that the fit predicts.

`profile_model` starts one job of N local processes (gloo on CPU, NCCL on
GPUs) and, for each parallel config in turn, runs the real runtime modules
(`StageModel`, `train_step`, `build_replica_groups`) on a sweep of packed
micro-batches; then it measures the collectives the runtime uses and the
trainer's phase after compute (gather, reduce, norm, AdamW: `optimizer_step`),
and writes the `hydraulis.profile/1` data (`ProfiledCostModel.from_dict` reads it).

What is timed, and why:

- Each config as N / (tp*pp*cp) replicas at once (the config's size must
  divide N), as a training deployment that keeps every rank busy. On a CPU
  with fewer cores than ranks x threads only as many replicas run at once
  as the cores hold (at least one): ranks beyond that would only time-slice
  the cores, and training often leaves replicas idle. The profile records
  the cores, the threads per rank and the ranks busy per config
  (`shared_cores`, `busy_ranks`), and the simulator replays a plan's
  replicas sharing the cores (cost.model.SharedCores). Configs take turns
  by rounds (warm-up, each timed repeat, memory), so that load from other
  processes, which drifts over minutes, spreads over all configs instead
  of biasing the planner's comparison of them; ranks not running the
  config wait at a barrier.
- Per pipeline stage, forward plus backward of ONE micro-batch. With pp = 1
  that is `train_step` itself. With pp > 1 every stage runs its
  `StageModel` forward and backward at once, its neighbours faked: a random
  input of the shape the previous stage would send, a random output
  gradient (the last stage takes the real loss). Timing the 1F1B of one
  micro-batch instead would serialise the stages and mix p2p waits into
  each; faking the neighbours measures exactly the cost model's t (one
  stage's compute), and the p2p is measured on its own below. A config's
  time is its slowest stage (the first holds the embedding, the last the
  head): in 1F1B's steady state the slowest stage sets the pace.
- Warm-up runs, then repeats taken round-robin over the sweep (a burst of
  load then hits one repeat of many points, and the median drops it,
  instead of every repeat of one point). A repeat starts
  after a barrier of the replica; a stage's time is the slowest of its TP
  ranks; a point's is the median over repeats, then over replicas. CPU:
  `time.perf_counter`; GPU: CUDA events.
- The sweep varies sum(s) and sum(s^2) independently: at each total T,
  k documents of T/k tokens (one long document down to many short ones)
  and one mixed micro-batch (T/2 plus four of T/8).
- With cp > 1 each CP rank runs its share of the micro-batch
  (`pack_cp_shard`: long documents split in zigzag chunks, K/V gathered over
  the CP group), as training does; its activation bytes per token count its
  own tokens, which is what the memory model divides by cp.

Memory: on GPUs `torch.cuda.max_memory_allocated` over one forward and
backward, minus what was allocated before it (static: parameters,
gradients, buffers). On CPU there is no allocator to ask, so the profiler
COUNTS TENSOR BYTES: parameters and gradients (static), and the tensors
autograd saves for backward (`torch.autograd.graph.saved_tensors_hooks`,
each storage once, parameters excluded) as the activations; the profile
says which method it used.

Coefficients come from a robust fit (cost/fit.py); a third of the points is
held out of a second fit, and its error on them is the fidelity stored with
the profile. This is the only module outside runtime/ that imports torch.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import queue
import re
import resource
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hydraulis.cost.fit import fidelity, fit_link, fit_robust, holdout_fidelity
from hydraulis.cost.memory import CAP_GRANULARITY, TrainingState
from hydraulis.cost.profiled import PROFILE_SCHEMA
from hydraulis.cost.sweep import ProfileSettings, check_configs, parse_configs, sweep
from hydraulis.errors import HydraulisError
from hydraulis.parallel import ParallelConfig, Replica
from hydraulis.runtime.batch import PackedBatch, pack_cp_shard
from hydraulis.runtime.groups import ReplicaGroups, build_replica_groups
from hydraulis.runtime.launch import DistEnv, init_distributed, spawn
from hydraulis.runtime.model import StageModel
from hydraulis.runtime.pipeline import micro_batch_loss, train_step
from hydraulis.specs import GiB, ModelSpec

__all__ = [
    "CPU_MEMORY_METHOD",
    "CUDA_MEMORY_METHOD",
    "ProfileSettings",
    "build_profile",
    "check_job",
    "describe_device",
    "measure",
    "parse_configs",
    "profile_model",
    "progress_steps",
    "summary_rows",
    "sweep",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # cost.sweep.DTYPE_NAMES
# Idle ranks wait at a barrier while a config runs; a large model's sweep can take minutes.
JOB_TIMEOUT = datetime.timedelta(minutes=30)
CPU_MEMORY_METHOD = (
    "cpu: counted tensor bytes (parameters and gradients as static; tensors saved by autograd for backward, "
    "via torch.autograd.graph.saved_tensors_hooks, as activations), not an allocator's peak"
)
CUDA_MEMORY_METHOD = "cuda: torch.cuda.max_memory_allocated over one forward+backward, minus memory_allocated before"


def check_job(spec: ModelSpec, configs: Sequence[ParallelConfig], nproc: int | None, device: str) -> int:
    """Every check that can fail before a process starts; returns the world size."""
    world = check_configs(spec, configs, nproc, device)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise HydraulisError("device cuda was asked for, but torch sees no GPU")
        if world > torch.cuda.device_count():
            raise HydraulisError(f"{world} processes but only {torch.cuda.device_count()} GPUs")
    return world


# ---------------------------------------------------------------- on every rank


class _Clock:
    """Seconds of a callable: CUDA events on a GPU (the stream's time), perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def _barrier(group: dist.ProcessGroup | None, clock: _Clock) -> None:
    clock.sync()
    if group is not None:
        dist.barrier(group=group)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _SavedTensors:
    """Bytes of the tensors autograd saves for backward, each storage once, parameters excluded."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params if p.numel()}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.skip:
            self.storages.setdefault(ptr, storage.nbytes())
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


class _StageRunner:
    """One forward and backward of one micro-batch on this rank's stage (see the module docstring)."""

    def __init__(self, model: StageModel, groups: ReplicaGroups, batches: Sequence[PackedBatch], seed: int) -> None:
        self.model, self.groups = model, groups
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.batches = [b.to(self.device) for b in batches]
        g = torch.Generator(device="cpu").manual_seed(seed + 7919 * groups.stage)
        hidden = model.spec.hidden
        # Fake neighbours: inputs of the size of a real residual stream, small output gradients.
        self.inputs = [
            None
            if groups.is_first_stage
            else torch.randn(b.num_tokens, hidden, generator=g).to(self.device, self.dtype)
            for b in batches
        ]
        self.grads = [
            None
            if groups.is_last_stage
            else (torch.randn(b.num_tokens, hidden, generator=g) * 1e-3).to(self.device, self.dtype)
            for b in batches
        ]

    def __call__(self, i: int) -> None:
        batch, groups = self.batches[i], self.groups
        targets = max(1, batch.num_targets)
        for p in self.model.parameters():
            p.grad = None  # as the trainer leaves them: backward allocates the gradients afresh
        if groups.config.pp == 1:
            train_step(self.model, groups, [batch], targets, reduce_partial_grads=False)
            return
        x = batch.tokens if groups.is_first_stage else self.inputs[i].detach().requires_grad_()
        out = self.model(x, batch)
        if groups.is_last_stage:
            (micro_batch_loss(self.model, out, batch) / targets).backward()
        else:
            out.backward(self.grads[i])


class _ConfigRun:
    """One config's measurements on this rank, taken a round at a time (see `measure` for the order)."""

    def __init__(
        self,
        spec: ModelSpec,
        groups: ReplicaGroups,
        documents: Sequence[Sequence[torch.Tensor]],
        settings: ProfileSettings,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.groups, self.settings = groups, settings
        batches = [pack_cp_shard(docs, groups.cp.size, groups.cp.rank) for docs in documents]
        self.model = StageModel(spec, groups.tp, groups.stage, groups.config.pp, dtype, device, cp=groups.cp)
        self.run = _StageRunner(self.model, groups, batches, settings.seed)
        self.clock = _Clock(device)
        self.count = len(batches)
        self.times = [[0.0] * settings.repeats for _ in batches]
        self.activation = [0] * len(batches)
        self.static = 0

    def warmup(self, i: int) -> None:
        for _ in range(self.settings.warmup):
            self.run(i)

    def timed(self, i: int, repeat: int) -> None:
        _barrier(self.groups.replica_group, self.clock)
        self.times[i][repeat] = self.clock.time(lambda: self.run(i))

    def memory(self, i: int) -> None:
        _barrier(self.groups.replica_group, self.clock)
        params = list(self.model.parameters())
        if self.clock.cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            self.run(i)
            torch.cuda.synchronize()
            self.activation[i] = int(torch.cuda.max_memory_allocated() - before)
        else:
            saved = _SavedTensors(params)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                self.run(i)
            self.activation[i] = saved.total
        grads = [p.grad for p in params if p.grad is not None]
        self.static = sum(_tensor_bytes(p) for p in params) + sum(_tensor_bytes(g) for g in grads)

    def result(self) -> dict[str, Any]:
        return {
            "config": self.groups.config.name,
            "stage": self.groups.stage,
            "tp_rank": self.groups.tp.rank,
            "cp_rank": self.groups.cp.rank,
            "tokens": [b.num_tokens for b in self.run.batches],
            "times_s": self.times,
            "activation_bytes": self.activation,
            "static_bytes": int(self.static),
            "params": int(sum(p.numel() for p in self.model.parameters())),
        }


def _measure_collectives(
    env: DistEnv, settings: ProfileSettings, report: Callable[[str, int], None] | None
) -> dict[str, Any]:
    """all_to_all_single with split sizes over the whole job (the optimizer's exchanges), and p2p ping-pong."""
    world, device = env.world_size, env.device
    clock = _Clock(device)
    a2a = []
    for nbytes in settings.collective_bytes:
        per_peer = max(1, nbytes // 4 // world)
        splits = [per_peer] * world
        send = torch.ones(per_peer * world, dtype=torch.float32, device=device)
        recv = torch.empty_like(send)

        def exchange(send=send, recv=recv, splits=splits) -> None:
            dist.all_to_all_single(recv, send, splits, splits)

        exchange()
        durations = []
        for _ in range(settings.collective_repeats):
            _barrier(dist.group.WORLD, clock)
            durations.append(clock.time(exchange))
        a2a.append({"bytes": per_peer * 4 * (world - 1), "times_s": durations})
        if report:
            report("collectives", 1)
    # Ping-pong between the first two ranks on a pipeline lane's group, as the pipeline sends activations.
    lane = build_replica_groups([Replica(ParallelConfig(1, 2), (0, 1))], timeout=JOB_TIMEOUT)
    p2p = []
    for nbytes in settings.collective_bytes:
        buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        if lane is not None:
            peer = lane.next_rank if lane.is_first_stage else lane.prev_rank
            first = lane.is_first_stage

            def ping(buf=buf, peer=peer, first=first, group=lane.pp_group) -> None:
                for op in (dist.isend, dist.irecv) if first else (dist.irecv, dist.isend):
                    for work in dist.batch_isend_irecv([dist.P2POp(op, buf, peer, group=group)]):
                        work.wait()

            ping()
            durations = []
            for _ in range(settings.collective_repeats):
                _barrier(lane.pp_group, clock)
                durations.append(clock.time(ping) / 2)
            p2p.append({"bytes": _tensor_bytes(buf), "times_s": durations})
        if report:
            report("collectives", 1)
    dist.barrier()
    return {"all_to_all": a2a, "p2p": p2p if env.rank == 0 else []}


def _filling(config: ParallelConfig, world: int) -> tuple[Replica, ...]:
    """Replicas of `config` on consecutive ranks, as many as fill the job."""
    n = config.num_gpus
    return tuple(Replica(config, tuple(range(j * n, (j + 1) * n))) for j in range(world // n))


def _measure_optimizer_step(
    spec: ModelSpec,
    configs: Sequence[ParallelConfig],
    settings: ProfileSettings,
    env: DistEnv,
    dtype: torch.dtype,
    report: Callable[[str, int], None] | None,
) -> dict[str, list[float]]:
    """Seconds of the trainer's phase after compute, per config, on a deployment of it filling the job.

    Exactly what `Trainer.run_iteration` runs besides the micro-batches: gather
    the compute shard from the optimizer's owners, reduce the gradients into
    them, the global norm's all-reduce and AdamW on the owned range. A
    repeat starts after a barrier; the slowest rank counts (build_profile).
    """
    from hydraulis.parallel import Deployment
    from hydraulis.runtime.deployments import Deployments
    from hydraulis.runtime.layout import ModelLayout
    from hydraulis.runtime.optimizer import AdamW, DisaggregatedOptimizer

    world, clock = env.world_size, _Clock(env.device)
    optimizer = DisaggregatedOptimizer(ModelLayout(spec, world), env.rank, AdamW(), env.device)
    optimizer.init(settings.seed)
    pool = [Deployment(_filling(c, world)) for c in configs]
    deployments = Deployments(spec, pool, optimizer, dtype, env.device, timeout=JOB_TIMEOUT)
    times: dict[str, list[float]] = {}
    for i, config in enumerate(configs):
        part, _ = deployments.activate(i)

        def phase(part=part) -> None:
            deployments.gather(part)
            optimizer.reduce(part.exchange, part.params)
            norm, _ = optimizer.global_norm()
            optimizer.step(1e-6, norm)

        durations = []
        for repeat in range(settings.collective_repeats + 1):
            for q in part.params:
                q.grad = torch.zeros_like(q)
            _barrier(dist.group.WORLD, clock)
            t = clock.time(phase)
            if repeat:  # the first is a warm-up
                durations.append(t)
        times[config.name] = durations
        if report:
            report("optimizer step", 1)
    dist.barrier()
    return times


def _context_bytes(device: torch.device) -> int:
    """Memory the process holds before any model: the CUDA context (GPU) or the interpreter and libraries (CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(max(0, total - free - torch.cuda.memory_reserved(device)))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def replicas_at_once(config: ParallelConfig, world: int, cores: int | None, threads: int) -> int:
    """Replicas of `config` that compute at once: all on GPUs; on a CPU as many as the cores hold, at least one."""
    replicas = world // config.num_gpus
    if cores is None:
        return replicas
    return max(1, min(replicas, (cores // threads) // config.num_gpus))


def measure(
    spec: ModelSpec,
    configs: Sequence[ParallelConfig],
    settings: ProfileSettings,
    env: DistEnv,
    report: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """This rank's raw measurements; every rank of an initialized job calls it (a collective).

    `profile_model` spawns the job and assembles the ranks' results with
    `build_profile`; a job started otherwise (torchrun) can call these two
    itself. `report(label, steps)` is called on rank 0 as work finishes.
    """
    report = report if env.rank == 0 else None
    dtype = DTYPES[settings.dtype_for(env.device.type)]
    context = _context_bytes(env.device)
    g = torch.Generator().manual_seed(settings.seed)
    documents = [[torch.randint(0, spec.vocab, (s,), generator=g) for s in lengths] for lengths in sweep(settings)]
    cores = cpu_cores() if env.device.type == "cpu" else None
    threads = torch.get_num_threads()
    groups: dict[ParallelConfig, ReplicaGroups | None] = {}
    busy: dict[str, int] = {}
    for config in configs:  # new_group is a collective of the whole job: every rank, same order
        n = config.num_gpus
        mine = build_replica_groups(_filling(config, env.world_size), timeout=JOB_TIMEOUT)
        at_once = replicas_at_once(config, env.world_size, cores, threads)
        busy[config.name] = at_once * n
        groups[config] = mine if env.rank // n < at_once else None  # the others wait at the barrier
    rounds = 1 + settings.repeats + 1  # warm-up, timed repeats, memory
    order = (
        [(r, c) for r in range(rounds) for c in configs]
        if settings.interleave
        else [(r, c) for c in configs for r in range(rounds)]
    )
    runs: dict[ParallelConfig, _ConfigRun] = {}
    measured: dict[str, Any] = {}
    for r, config in order:
        mine = groups[config]
        if mine is not None:
            if config not in runs:
                runs[config] = _ConfigRun(spec, mine, documents, settings, env.device, dtype)
            run = runs[config]
            for i in range(run.count):
                if r == 0:
                    run.warmup(i)
                elif r <= settings.repeats:
                    run.timed(i, r - 1)
                else:
                    run.memory(i)
                if report:
                    report(config.name, 1)
            if r == rounds - 1:  # the config's last round: free its model
                measured[config.name] = runs.pop(config).result()
                if env.device.type == "cuda":
                    torch.cuda.empty_cache()
        dist.barrier()  # ranks without a replica of this config wait here
    collectives = _measure_collectives(env, settings, report) if env.world_size > 1 else None
    step = _measure_optimizer_step(spec, configs, settings, env, dtype, report)
    return {
        "rank": env.rank,
        "context_bytes": context,
        "threads": threads,
        "cores": cores,
        "busy_ranks": busy,
        "configs": measured,
        "collectives": collectives,
        "optimizer_step_s": step,
    }


def _worker(
    spec: ModelSpec, configs: tuple[ParallelConfig, ...], settings: ProfileSettings, device: str, progress: Any
) -> dict[str, Any]:
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    env = init_distributed(device, timeout=JOB_TIMEOUT)
    report = (lambda label, steps: progress.put((label, steps))) if progress is not None else None
    return measure(spec, configs, settings, env, report)


def progress_steps(configs: Sequence[ParallelConfig], settings: ProfileSettings, world: int) -> int:
    """How many `report` steps a job makes (for a progress bar's total)."""
    per_config = len(sweep(settings)) * (1 + settings.repeats + 1) + 1  # + the optimizer step
    return len(configs) * per_config + (2 * len(settings.collective_bytes) if world > 1 else 0)


# ---------------------------------------------------------------- assembling the profile


def _point_times(config: ParallelConfig, ranks: Sequence[dict[str, Any]], world: int) -> tuple[list, list]:
    """Per point: the config's time (slowest stage, median over repeats, then replicas) and per-stage times."""
    per_rank = {
        r["rank"]: np.asarray(r["configs"][config.name]["times_s"]) for r in ranks if config.name in r["configs"]
    }  # [points, repeats]
    points = next(iter(per_rank.values())).shape[0]
    replica_times, replica_stages = [], []
    for replica in _filling(config, world):  # the replicas `measure` ran, on the same ranks
        if any(m not in per_rank for m in replica.devices):
            continue  # a replica that waited while the CPU's cores were taken
        # per stage and repeat, its slowest TP (and CP) rank
        stages = [np.max([per_rank[m] for m in replica.stage_devices(s)], axis=0) for s in range(config.pp)]
        stages_arr = np.stack(stages)  # [stage, point, repeat]
        replica_times.append(np.median(stages_arr.max(axis=0), axis=1))
        replica_stages.append(np.median(stages_arr, axis=2))
    times = np.median(np.stack(replica_times), axis=0)
    stage_times = np.median(np.stack(replica_stages), axis=0)  # [stage, point]
    return [float(t) for t in times], [[float(stage_times[s, i]) for s in range(config.pp)] for i in range(points)]


def _link(rows: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any] | None:
    """Per size: slowest rank per repeat, median over repeats; then latency and bandwidth."""
    rows = [r for r in rows if r]
    if not rows:
        return None
    sizes = [row["bytes"] for row in rows[0]]
    times = []
    for i in range(len(sizes)):
        per_repeat = np.max([np.asarray(r[i]["times_s"]) for r in rows], axis=0)
        times.append(float(np.median(per_repeat)))
    latency, bandwidth = fit_link(sizes, times)
    return {
        "latency_s": latency,
        "bandwidth_Bps": bandwidth,
        "points": [{"bytes": int(b), "time_s": t} for b, t in zip(sizes, times, strict=True)],
    }


def build_profile(
    spec: ModelSpec,
    configs: Sequence[ParallelConfig],
    settings: ProfileSettings,
    ranks: Sequence[dict[str, Any]],
    device: dict[str, Any],
    name: str | None = None,
) -> dict[str, Any]:
    """The `hydraulis.profile/1` data from every rank's `measure` result."""
    world = len(ranks)
    points = sweep(settings)
    shared = ranks[0].get("cores") is not None  # CPU ranks sharing cores (see SharedCores)
    time_rows, measurements, fits = [], [], {}
    activation: dict[int, float] = {}
    min_eff: dict[int, int] = {}
    state_per_param = 0.0
    L, H = spec.layers, spec.hidden
    for config in configs:
        times, stage_times = _point_times(config, ranks, world)
        fit = fit_robust(points, times)
        held = holdout_fidelity(points, times, settings.holdout_fraction, settings.seed)
        co = fit.coefficients
        predicted = [t * (1 + r) for t, r in zip(times, fit.residuals, strict=True)]
        fits[config.name] = {"holdout": held, "fit": fidelity(predicted, times)}
        row = {
            "tp": config.tp,
            "pp": config.pp,
            **({"cp": config.cp} if config.cp > 1 else {}),
            "a": co.a * 1e3,
            "b": co.b * 1e3,
            "c": co.c * 1e3,
            "fit_loss": "soft_l1 on relative residuals, a, b, c >= 0",
            "holdout_median_abs_rel_error": held["median_abs_rel_error"],
            "holdout_worst_abs_rel_error": held["worst_abs_rel_error"],
        }
        if shared:
            row["busy_ranks"] = ranks[0]["busy_ranks"][config.name]
        time_rows.append(row)
        # Memory: per stage, activation bytes per token (most over the points, the TP ranks, the replicas).
        rows = [r["configs"][config.name] for r in ranks if config.name in r["configs"]]
        per_stage = [0.0] * config.pp
        for row in rows:
            # per token the rank holds (its CP share), as the memory model's per-token bytes / cp assumes
            held_tokens = row.get("tokens") or [sum(p) for p in points]
            per_token = max(b / t for b, t in zip(row["activation_bytes"], held_tokens, strict=True))
            per_stage[row["stage"]] = max(per_stage[row["stage"]], per_token)
            state_per_param = max(state_per_param, row["static_bytes"] / max(1, row["params"]))
        # 1F1B: stage s holds pp - s micro-batches at its peak; the memory model's factor covers all L layers.
        peak_per_token = max((config.pp - s) * per_stage[s] for s in range(config.pp))
        factor = peak_per_token / (L * H / config.tp)
        activation[config.tp] = max(activation.get(config.tp, 0.0), factor)
        # Fewest tokens for which per-token work outweighs the per-micro-batch overhead c.
        tokens = max(points[-1]) if co.b <= 0 else co.c / co.b
        rounded = int(math.ceil(tokens / CAP_GRANULARITY) * CAP_GRANULARITY)
        min_eff[config.tp] = max(min_eff.get(config.tp, 0), min(rounded, max(sum(p) for p in points)))
        for i, lengths in enumerate(points):
            measurements.append(
                {
                    "config": config.name,
                    "lengths": list(lengths),
                    "time_ms": times[i] * 1e3,
                    "stage_ms": [t * 1e3 for t in stage_times[i]],
                    "fit_rel_residual": fit.residuals[i],
                    "activation_bytes_per_token": max(r["activation_bytes"][i] for r in rows) / sum(lengths),
                }
            )
    held = TrainingState()
    state_total = state_per_param + held.sharded_bytes
    memory_bytes = int(device["memory_bytes"])
    is_cuda = device["kind"] == "cuda"
    memory = {
        "method": CUDA_MEMORY_METHOD if is_cuda else CPU_MEMORY_METHOD,
        "activation_bytes_per_token_hidden_layer": {str(tp): activation[tp] for tp in sorted(activation)},
        "state_bytes_per_hidden2_layer": state_total * spec.params_per_layer / (H * H),
        "optimizer_sharded_fraction": held.sharded_bytes / state_total,
        "embedding_state_bytes": state_total,
        "context_overhead_bytes": float(max(r["context_bytes"] for r in ranks)),
        "safety_margin_bytes": float(max(6 * GiB, 0.075 * memory_bytes) if is_cuda else 0.1 * memory_bytes),
        "measured_state_bytes_per_param": state_per_param,
    }
    data: dict[str, Any] = {
        "schema": PROFILE_SCHEMA,
        "name": name or f"{spec.name}@{device['name']}-measured",
        "source": (
            f"hydraulis profile on {device['description']}: {world} {device['backend']} process(es), "
            f"{device['dtype']}, torch {torch.__version__}. Per stage forward+backward of one packed micro-batch "
            "(neighbouring stages faked for pp > 1), median of repeats, slowest stage; robust fit. " + memory["method"]
        ),
        "model": asdict(spec),
        "device": {k: device[k] for k in ("name", "memory_bytes", "gpus_per_node", "kind", "dtype", "description")},
        "time_ms": time_rows,
        "memory": memory,
        "min_efficient_tokens": {str(tp): v for tp, v in sorted(min_eff.items())},
        "fidelity": fits,
        "measurements": {
            "settings": settings.to_json(),
            "points": measurements,
            "world_size": world,
        },
    }
    if all("optimizer_step_s" in r for r in ranks):
        # Per repeat the slowest rank (the collectives wait for it), then the median over repeats.
        step = {
            c.name: float(np.median(np.max([r["optimizer_step_s"][c.name] for r in ranks], axis=0))) * 1e3
            for c in configs
        }
        data["optimizer_step"] = {"world_size": world, "ms": step}
    if shared:
        data["shared_cores"] = {"cores": ranks[0]["cores"], "threads_per_rank": ranks[0]["threads"]}
    if world > 1 and ranks[0]["collectives"] is not None:
        a2a = _link([r["collectives"]["all_to_all"] for r in ranks])
        p2p = _link([r["collectives"]["p2p"] for r in ranks])
        data["collectives"] = {"world_size": world, "all_to_all": a2a, "p2p": p2p}
        data["collectives"] = {k: v for k, v in data["collectives"].items() if v is not None}
    return data


def describe_device(device: str, world: int, dtype: str, threads: int) -> dict[str, Any]:
    """Name, memory per rank and topology of this machine, as the profile records them."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        slug = re.sub(r"[^a-z0-9]+", "-", props.name.lower()).strip("-")
        return {
            "name": slug,
            "kind": "cuda",
            "memory_bytes": int(props.total_memory),
            "gpus_per_node": torch.cuda.device_count(),
            "backend": "nccl",
            "dtype": dtype,
            "description": f"{torch.cuda.device_count()} x {props.name}",
        }
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cores = os.cpu_count() or 1
    return {
        "name": "cpu",
        "kind": "cpu",
        "memory_bytes": int(pages // world),  # the machine's memory, shared by the ranks
        "gpus_per_node": 64,  # as the `cpu` device: every rank is on this one host
        "backend": "gloo",
        "dtype": dtype,
        "description": f"{platform.machine()} CPU, {cores} core(s), {threads} torch thread(s) per rank",
    }


def profile_model(
    spec: ModelSpec,
    configs: Sequence[ParallelConfig],
    nproc: int | None = None,
    device: str = "cpu",
    settings: ProfileSettings | None = None,
    name: str | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """Profile `configs` of `spec` on `nproc` local processes; returns the `hydraulis.profile/1` data.

    `progress(label, steps)` is called in this process as the job advances
    (`progress_steps` gives the total). Bad input raises HydraulisError before
    any process starts.
    """
    settings = settings or ProfileSettings()
    configs = tuple(configs)
    world = check_job(spec, configs, nproc, device)
    channel = None
    listener = None
    if progress is not None:
        import multiprocessing

        channel = multiprocessing.get_context("spawn").Queue()
        stop = threading.Event()

        def forward() -> None:
            while not stop.is_set():
                try:
                    label, steps = channel.get(timeout=0.1)
                except queue.Empty:
                    continue
                progress(label, steps)

        listener = threading.Thread(target=forward, daemon=True)
        listener.start()
    started = time.perf_counter()
    try:
        ranks = spawn(_worker, world, spec, configs, settings, device, channel)
    finally:
        if listener is not None:
            time.sleep(0.2)  # let the last reports through
            stop.set()
            listener.join(timeout=1)
    info = describe_device(device, world, settings.dtype_for(device), ranks[0]["threads"])
    data = build_profile(spec, configs, settings, ranks, info, name)
    data["measurements"]["wall_s"] = time.perf_counter() - started
    return data


def summary_rows(data: dict[str, Any]) -> list[list[str]]:
    """One table row per config: coefficients and how well they predict held-out micro-batches."""
    rows = []
    for row in data["time_ms"]:
        config = ParallelConfig(row["tp"], row["pp"], row.get("cp", 1)).name
        fid = data["fidelity"][config]
        rows.append(
            [
                config,
                f"{row['a']:.3g}",
                f"{row['b']:.3g}",
                f"{row['c']:.3g}",
                f"{fid['fit']['median_abs_rel_error']:.1%}",
                f"{fid['holdout']['median_abs_rel_error']:.1%}",
                f"{fid['holdout']['worst_abs_rel_error']:.1%}",
            ]
        )
    return rows
