"""Measure the runtime on this machine, fit the cost model to it, and show that the fit predicts.

`profile_model` starts one job of N local processes (gloo on CPU, NCCL on
GPUs) and, for each parallel config in turn, runs the real runtime modules
(`StageModel`, `train_step`, `build_replica_groups`) on a sweep of packed
micro-batches; then it measures the collectives the runtime uses and the
trainer's phase after compute (gather, reduce, norm, AdamW: `optimizer_step`),
and returns the `hydraulis.profile/1` data (`ProfiledCostModel.from_dict` reads it).

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
  (`concatenate_cp_shard`: long documents split in zigzag chunks, K/V gathered over
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
the profile.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import platform
import queue
import re
import resource
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hydraulis.cost.conditions import CpuMeter, cpu_cores, disturbed
from hydraulis.cost.measured import build_profile, filling_replicas
from hydraulis.cost.sweep import ProfileSettings, check_configs, sweep
from hydraulis.errors import HydraulisError
from hydraulis.parallel import ParallelConfig
from hydraulis.runtime.metering.measurements import JOB_TIMEOUT, ConfigRun, measure_collectives, measure_optimizer_step
from hydraulis.runtime.parallelism.groups import ReplicaGroups, build_replica_groups
from hydraulis.runtime.parallelism.launch import DTYPES, DistEnv, init_distributed, spawn
from hydraulis.specs import ModelSpec


def check_job(spec: ModelSpec, configs: Sequence[ParallelConfig], nproc: int | None, device: str) -> int:
    """Every check that can fail before a process starts; returns the world size."""
    world = check_configs(spec, configs, nproc, device)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise HydraulisError("device cuda was asked for, but torch sees no GPU")
        if world > torch.cuda.device_count():
            raise HydraulisError(f"{world} processes but only {torch.cuda.device_count()} GPUs")
    return world


def _context_bytes(device: torch.device) -> int:
    """Memory the process holds before any model: the CUDA context (GPU) or the interpreter and libraries (CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(max(0, total - free - torch.cuda.memory_reserved(device)))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def replicas_at_once(config: ParallelConfig, world: int, cores: int | None, threads: int) -> int:
    """Replicas of `config` that compute at once: all on GPUs; on a CPU as many as the cores hold, at least one."""
    replicas = world // config.num_gpus
    if cores is None:
        return replicas
    return max(1, min(replicas, (cores // threads) // config.num_gpus))


class LoadCheck:
    """Other processes' load over each timed round (rank 0 reads it), and whether every rank measures it again.

    Why: a round timed while something else computed is slower by the cores it took, and the
    profile would carry that into every prediction. A disturbed round (cost.conditions.disturbed)
    runs again, up to `retries` times, and at most `budget` rounds in all run again: a load that
    lasts the whole profile would only triple its time. The profile records the load of the
    rounds it kept.
    """

    def __init__(self, env: DistEnv, cores: int | None, retries: int, budget: int) -> None:
        self.env = env
        self.cores = cores
        self.retries = retries
        self.budget = budget
        self.meter = None
        if cores is not None:  # CPU ranks: the load that matters is the CPU's
            pids: list[Any] = [None] * env.world_size
            dist.all_gather_object(pids, os.getpid())
            # the job's own: the ranks, the fork server that forked them and the launcher
            parent = multiprocessing.parent_process()
            job = {*pids, os.getppid(), *([parent.pid] if parent is not None else [])}
            self.meter = CpuMeter(sorted(job)) if env.rank == 0 else None
        self.kept: list[float] = []  # foreign cores of every kept timed round (rank 0)
        self.redone = 0

    def start(self) -> None:
        if self.meter is not None:
            self.meter.foreign_cores()  # the next reading covers the round from here

    def again(self, attempt: int) -> bool:
        """After a timed round (a collective): True on every rank when it should be measured again."""
        if self.cores is None:
            return False
        load = self.meter.foreign_cores() if self.meter is not None else None
        again = disturbed(load, self.cores) and attempt < self.retries and self.redone < self.budget
        flag = torch.tensor([1 if again else 0])
        dist.broadcast(flag, 0)
        if int(flag):
            self.redone += 1
        elif load is not None:
            self.kept.append(load)
        return bool(int(flag))

    def result(self) -> dict[str, Any] | None:
        if not self.kept:
            return None
        return {"foreign_cores_median": float(np.median(self.kept)), "foreign_cores_max": float(max(self.kept)),
                "disturbed_kept": sum(disturbed(x, self.cores) for x in self.kept), "measured_again": self.redone}


def _config_round(run: ConfigRun, r: int, repeats: int, report: Callable[[str, int], None] | None) -> None:
    """One round of one config on this rank: warm-up (0), a timed repeat (1..repeats) or the memory census."""
    for i in range(run.count):
        if r == 0:
            run.warmup(i)
        elif r <= repeats:
            run.timed(i, r - 1)
        else:
            run.memory(i)
        if report:
            report(run.groups.config.name, 1)


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
        mine = build_replica_groups(filling_replicas(config, env.world_size), timeout=JOB_TIMEOUT, replica_group=True)
        at_once = replicas_at_once(config, env.world_size, cores, threads)
        busy[config.name] = at_once * n
        groups[config] = mine if env.rank // n < at_once else None  # the others wait at the barrier
    rounds = 1 + settings.repeats + 1  # warm-up, timed repeats, memory
    order = (
        [(r, c) for r in range(rounds) for c in configs]
        if settings.interleave
        else [(r, c) for c in configs for r in range(rounds)]
    )
    load = LoadCheck(env, cores, settings.load_retries, budget=max(1, settings.repeats * len(configs) // 2))
    runs: dict[ParallelConfig, ConfigRun] = {}
    measured: dict[str, Any] = {}
    for r, config in order:
        mine = groups[config]
        if mine is not None and config not in runs:
            runs[config] = ConfigRun(
                spec, mine, documents=documents, settings=settings, device=env.device, dtype=dtype
            )
        for attempt in range(settings.load_retries + 1):
            load.start()
            if mine is not None:
                _config_round(runs[config], r, settings.repeats, report if attempt == 0 else None)
            dist.barrier()  # ranks without a replica of this config wait here
            if not 1 <= r <= settings.repeats or not load.again(attempt):
                break
        if mine is not None and r == rounds - 1:  # the config's last round: free its model
            measured[config.name] = runs.pop(config).result()
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
    collectives = measure_collectives(env, settings, report) if env.world_size > 1 else None
    step = measure_optimizer_step(spec, configs, settings=settings, env=env, dtype=dtype, report=report)
    return {
        "rank": env.rank, "context_bytes": context, "threads": threads, "cores": cores, "busy_ranks": busy,
        "configs": measured, "collectives": collectives, "optimizer_step_s": step, "load": load.result(),
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
            "torch": torch.__version__,
        }
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cores = cpu_cores()
    return {
        "name": "cpu",
        "kind": "cpu",
        "memory_bytes": int(pages // world),  # the machine's memory, shared by the ranks
        "gpus_per_node": 64,  # as the `cpu` device: every rank is on this one host
        "backend": "gloo",
        "dtype": dtype,
        "description": f"{platform.machine()} CPU, {cores} core(s), {threads} torch thread(s) per rank",
        "torch": torch.__version__,
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
        job = functools.partial(_worker, spec, configs, settings=settings, device=device, progress=channel)
        ranks = spawn(job, world)
    finally:
        if listener is not None:
            time.sleep(0.2)  # let the last reports through
            stop.set()
            listener.join(timeout=1)
    info = describe_device(device, world, settings.dtype_for(device), ranks[0]["threads"])
    data = build_profile(spec, configs, settings=settings, ranks=ranks, device=info, name=name)
    data["measurements"]["wall_s"] = time.perf_counter() - started
    return data


