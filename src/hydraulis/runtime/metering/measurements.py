"""What the profiler times on every rank: one config's stages, the collectives, the optimizer phase.

profiler.py decides what runs when and gathers the results; these are the
measurements themselves (see profiler.py's docstring for why each is taken
the way it is). CPU: `time.perf_counter`; GPU: CUDA events.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hydraulis.cost.measured import filling_replicas
from hydraulis.cost.policies import LIGHTEST_FIRST, MemoryPolicy
from hydraulis.cost.sweep import ProfileSettings
from hydraulis.parallel import ParallelConfig, Replica
from hydraulis.runtime.modeling.model import StageModel
from hydraulis.runtime.parallelism.batch import MicroBatchInput, concatenate_cp_shard
from hydraulis.runtime.parallelism.groups import ReplicaGroups, build_replica_groups
from hydraulis.runtime.parallelism.launch import DistEnv
from hydraulis.runtime.pipeline.one_f_one_b import micro_batch_loss
from hydraulis.runtime.pipeline.step import train_step
from hydraulis.specs import ModelSpec

# Idle ranks wait at a barrier while a config runs; a large model's sweep can take minutes.
JOB_TIMEOUT = datetime.timedelta(minutes=30)


class Clock:
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


def barrier(group: dist.ProcessGroup | None, clock: Clock) -> None:
    clock.sync()
    if group is not None:
        dist.barrier(group=group)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class SavedTensors:
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


class StageRunner:
    """One forward and backward of one micro-batch on this rank's stage (see the module docstring)."""

    def __init__(self, model: StageModel, groups: ReplicaGroups, batches: Sequence[MicroBatchInput], seed: int) -> None:
        self.model = model
        self.groups = groups
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
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

    def __call__(self, i: int, policy: MemoryPolicy = MemoryPolicy.NONE) -> None:
        batch, groups = dataclasses.replace(self.batches[i], policy=int(policy)), self.groups
        targets = max(1, batch.num_targets)
        for p in self.model.parameters():
            p.grad = None  # as the trainer leaves them: backward allocates the gradients afresh
        if groups.config.pp == 1:
            train_step(self.model, groups, [batch], targets, reduce_partial_grads=False)
            return
        x = batch.tokens if groups.is_first_stage else self.inputs[i].detach().requires_grad_()
        if groups.is_last_stage:
            (micro_batch_loss(self.model, x, batch) / targets).backward()
        else:
            self.model(x, batch).backward(self.grads[i])


class ConfigRun:
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
        self.groups = groups
        self.settings = settings
        batches = [concatenate_cp_shard(docs, groups.cp.size, groups.cp.rank) for docs in documents]
        self.model = StageModel(
            spec, groups.tp, stage=groups.stage, num_stages=groups.config.pp, dtype=dtype, device=device, cp=groups.cp
        )
        self.run = StageRunner(self.model, groups, batches, settings.seed)
        self.clock = Clock(device)
        self.count = len(batches)
        self.times = [[0.0] * settings.repeats for _ in batches]
        # The memory policies' recompute, timed at the sweep's longest point beside its plain run.
        self.longest = max(range(len(batches)), key=lambda i: batches[i].num_tokens)
        self.policy_times = {p.label: [0.0] * settings.repeats for p in LIGHTEST_FIRST[1:]}
        self.activation = [0] * len(batches)
        self.static = 0

    def warmup(self, i: int) -> None:
        for _ in range(self.settings.warmup):
            self.run(i)

    def timed(self, i: int, repeat: int) -> None:
        barrier(self.groups.replica_group, self.clock)
        self.times[i][repeat] = self.clock.time(lambda: self.run(i))
        if i == self.longest:
            for p in LIGHTEST_FIRST[1:]:
                barrier(self.groups.replica_group, self.clock)
                self.policy_times[p.label][repeat] = self.clock.time(lambda p=p: self.run(i, p))

    def memory(self, i: int) -> None:
        barrier(self.groups.replica_group, self.clock)
        params = list(self.model.parameters())
        if self.clock.cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            self.run(i)
            torch.cuda.synchronize()
            self.activation[i] = int(torch.cuda.max_memory_allocated() - before)
        else:
            saved = SavedTensors(params)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                self.run(i)
            self.activation[i] = saved.total
        grads = [p.grad for p in params if p.grad is not None]
        self.static = sum(tensor_bytes(p) for p in params) + sum(tensor_bytes(g) for g in grads)

    def result(self) -> dict[str, Any]:
        return {
            "config": self.groups.config.name,
            "stage": self.groups.stage,
            "tp_rank": self.groups.tp.rank,
            "cp_rank": self.groups.cp.rank,
            "tokens": [b.num_tokens for b in self.run.batches],
            "times_s": self.times,
            "policy_point": self.longest,
            "policy_times_s": self.policy_times,
            "activation_bytes": self.activation,
            "static_bytes": int(self.static),
            "params": int(sum(p.numel() for p in self.model.parameters())),
        }


def measure_collectives(
    env: DistEnv, settings: ProfileSettings, report: Callable[[str, int], None] | None
) -> dict[str, Any]:
    """all_to_all_single with split sizes over the whole job (the optimizer's exchanges), and p2p ping-pong."""
    world, device = env.world_size, env.device
    clock = Clock(device)
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
            barrier(dist.group.WORLD, clock)
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
                barrier(lane.pp_group, clock)
                durations.append(clock.time(ping) / 2)
            p2p.append({"bytes": tensor_bytes(buf), "times_s": durations})
        if report:
            report("collectives", 1)
    dist.barrier()
    return {"all_to_all": a2a, "p2p": p2p if env.rank == 0 else []}


def measure_optimizer_step(
    spec: ModelSpec,
    configs: Sequence[ParallelConfig],
    settings: ProfileSettings,
    env: DistEnv,
    dtype: torch.dtype,
    report: Callable[[str, int], None] | None,
) -> dict[str, dict[str, list[float]]]:
    """Seconds of the trainer's phase after compute, per config, on a deployment of it filling the job.

    Exactly what `Trainer.run_iteration` runs besides the micro-batches: gather
    the compute shard from the optimizer's owners, reduce the gradients into
    them, the global norm's all-reduce and AdamW on the owned range. A
    repeat starts after a barrier; the slowest rank counts (build_profile).
    Per config: the whole phase (`total`) and its gather and reduce alone,
    which training overlaps with compute (cost.model.CostModel.exchange_in_compute).
    """
    from hydraulis.optim import AdamWSettings
    from hydraulis.parallel import Deployment
    from hydraulis.runtime.deployments import BuiltDeployments
    from hydraulis.runtime.optimizer.exchange import reduce
    from hydraulis.runtime.optimizer.layout import ShardLayout
    from hydraulis.runtime.optimizer.sharded import ShardedOptimizer

    world, clock = env.world_size, Clock(env.device)
    optimizer = ShardedOptimizer(ShardLayout(spec, world), env.rank, AdamWSettings(), env.device)
    optimizer.init(settings.seed)
    pool = [Deployment(filling_replicas(c, world)) for c in configs]
    deployments = BuiltDeployments(spec, pool, optimizer, dtype, env.device, timeout=JOB_TIMEOUT)
    times: dict[str, dict[str, list[float]]] = {}
    for i, config in enumerate(configs):
        part, _ = deployments.activate(i)

        def update() -> None:
            norm, _ = optimizer.global_norm()
            optimizer.step(1e-6, norm)

        parts = {
            "gather": lambda part=part: deployments.gather(part),
            "reduce": lambda part=part: reduce(optimizer, part.exchange_plan, part.grads, unscale=part.grad_unscales),
            "update": update,
        }
        durations: dict[str, list[float]] = {"total": [], "gather": [], "reduce": []}
        for repeat in range(settings.collective_repeats + 1):
            for q in part.params:
                q.grad = torch.zeros_like(q)
            barrier(dist.group.WORLD, clock)
            taken = {name: clock.time(fn) for name, fn in parts.items()}
            if repeat:  # the first is a warm-up
                durations["total"].append(sum(taken.values()))
                durations["gather"].append(taken["gather"])
                durations["reduce"].append(taken["reduce"])
        times[config.name] = durations
        if report:
            report("optimizer step", 1)
    dist.barrier()
    return times
