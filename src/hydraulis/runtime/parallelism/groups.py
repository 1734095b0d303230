"""Process groups of one replica, built from any list of global ranks.

A replica is (ParallelConfig, global ranks), exactly `parallel.Replica` with
device ids read as global ranks (one process per GPU). Ranks are stage-major:
stage s owns ranks[s * tp * cp : (s + 1) * tp * cp]. Within a stage, local
index i = cp_rank * tp + tp_rank: TP groups are contiguous
(stage[c * tp : (c + 1) * tp] is CP rank c's TP group), CP groups strided
(one rank of each TP group). Within a TP group, TP ranks follow global rank
order (torch numbers a group's members in sorted order); a CP group's ranks
keep CP-rank order, and `ContextParallel.blocks` maps them to torch's
numbering. The ranks need not be contiguous or sorted, so several replicas
with different configs can share one job.

`torch.distributed.new_group` must be called by every rank of the job in the
same order, so `build_replica_groups` takes the WHOLE deployment's replicas
and every rank calls it; it returns the groups of the replica that holds the
calling rank. Groups are cached by their rank tuple, so deployments of a pool
that share replicas share groups.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hydraulis.errors import HydraulisError
from hydraulis.parallel import ParallelConfig, Replica
from hydraulis.runtime.parallelism.context_parallel import ContextParallel
from hydraulis.runtime.parallelism.tensor_parallel import TensorParallel

DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass(frozen=True)
class ReplicaGroups:
    """One rank's view of its replica: stage, TP and CP groups, pipeline neighbours."""

    config: ParallelConfig
    ranks: tuple[int, ...]
    rank: int
    stage: int
    tp: TensorParallel
    pp_group: dist.ProcessGroup | None  # same (CP, TP) rank on every stage: the p2p lane
    replica_group: dist.ProcessGroup | None  # all ranks of the replica (built only on request: the profiler's)
    prev_rank: int | None  # global rank of the same (CP, TP) rank on the previous stage
    next_rank: int | None
    cp: ContextParallel = ContextParallel()

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.config.pp - 1

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        return stage_ranks(self.config, self.ranks, self.stage, self.cp.rank)


def stage_ranks(config: ParallelConfig, ranks: Sequence[int], stage: int, cp_rank: int = 0) -> tuple[int, ...]:
    """One TP group of a stage (CP rank `cp_rank`'s) in TP-rank order: sorted, as torch numbers a group's ranks."""
    return tuple(sorted(Replica(config, tuple(ranks)).tp_group(stage, cp_rank)))


def cp_ranks(config: ParallelConfig, ranks: Sequence[int], stage: int, tp_rank: int) -> tuple[int, ...]:
    """One CP group of a stage (TP rank `tp_rank`'s), in CP-rank order."""
    return tuple(stage_ranks(config, ranks, stage, c)[tp_rank] for c in range(config.cp))


def lane_ranks(config: ParallelConfig, ranks: Sequence[int], tp_rank: int, cp_rank: int = 0) -> tuple[int, ...]:
    """The ranks with one (CP, TP) rank across all stages, in stage order: they pass activations to each other."""
    return tuple(stage_ranks(config, ranks, s, cp_rank)[tp_rank] for s in range(config.pp))


def rank_roles(config: ParallelConfig, ranks: Sequence[int]) -> dict[int, tuple[int, int, int]]:
    """Every rank of a replica -> (stage, cp_rank, tp_rank), by the layout of the module docstring."""
    return {
        rank: (stage, c, t)
        for stage in range(config.pp)
        for c in range(config.cp)
        for t, rank in enumerate(stage_ranks(config, ranks, stage, c))
    }


def check_replica(config: ParallelConfig, ranks: Sequence[int], world_size: int) -> None:
    if len(ranks) != config.num_gpus:
        raise HydraulisError(f"replica {config.name} needs {config.num_gpus} ranks, got {len(ranks)}")
    if len(set(ranks)) != len(ranks):
        raise HydraulisError(f"replica {config.name}: ranks {list(ranks)} repeat a rank")
    for r in ranks:
        if not 0 <= r < world_size:
            raise HydraulisError(f"replica {config.name}: rank {r} is outside 0..{world_size - 1}")


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup | None] = {}


def _group(ranks: tuple[int, ...], timeout: datetime.timedelta) -> dist.ProcessGroup | None:
    """A cached group for these ranks (every rank of the job must call this in the same order)."""
    if len(ranks) == 1:
        return None
    key = tuple(sorted(ranks))
    if key not in _GROUPS:
        group = dist.new_group(list(key), timeout=timeout)
        member = dist.get_rank() in key
        _GROUPS[key] = group if member else None
        if member and dist.get_backend(group) == "nccl":
            # Create the NCCL communicator now with all members, so later p2p batches
            # that involve only some of them do not hang on a lazy init.
            dist.all_reduce(torch.zeros(1, device="cuda"), group=group)
    return _GROUPS[key]


def built_groups() -> list[dist.ProcessGroup]:
    """Every group this process has built and belongs to."""
    return [g for g in _GROUPS.values() if g is not None]


def build_replica_groups(
    replicas: Sequence[Replica],
    sequence_parallel: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    replica_group: bool = False,
) -> ReplicaGroups | None:
    """Groups for every replica of a deployment; returns this rank's (None if it is in no replica).

    A collective: every rank of the job calls it with the same replicas in the same order. The group
    of a whole replica is built only when `replica_group` asks for it (training never uses it).
    """
    if not dist.is_initialized():
        raise HydraulisError("torch.distributed is not initialized; start the job with torchrun")
    world, me = dist.get_world_size(), dist.get_rank()
    seen: set[int] = set()
    for replica in replicas:
        check_replica(replica.config, replica.devices, world)
        if seen & set(replica.devices):
            raise HydraulisError(f"replica {replica.config.name}: ranks {list(replica.devices)} overlap another")
        seen |= set(replica.devices)
    mine = None
    for replica in replicas:
        config, ranks = replica.config, tuple(replica.devices)
        stages, cps, tps = range(config.pp), range(config.cp), range(config.tp)
        tp_groups = {(s, c): _group(stage_ranks(config, ranks, s, c), timeout) for s in stages for c in cps}
        cp_groups = {(s, t): _group(cp_ranks(config, ranks, s, t), timeout) for s in stages for t in tps}
        lanes = {(c, t): _group(lane_ranks(config, ranks, t, c), timeout) for c in cps for t in tps}
        whole = _group(ranks, timeout) if replica_group else None
        if me not in ranks:
            continue
        stage, cp_rank, tp_rank = rank_roles(config, ranks)[me]
        lane = lane_ranks(config, ranks, tp_rank, cp_rank)
        cp_members = cp_ranks(config, ranks, stage, tp_rank)
        mine = ReplicaGroups(
            config=config,
            ranks=ranks,
            rank=me,
            stage=stage,
            tp=TensorParallel(config.tp, tp_rank, tp_groups[stage, cp_rank], sequence_parallel and config.tp > 1),
            pp_group=lanes[cp_rank, tp_rank],
            replica_group=whole,
            prev_rank=lane[stage - 1] if stage > 0 else None,
            next_rank=lane[stage + 1] if stage < config.pp - 1 else None,
            cp=ContextParallel(
                config.cp, cp_rank, cp_groups[stage, tp_rank], tuple(sorted(cp_members).index(r) for r in cp_members)
            ),
        )
    return mine


def single_process_groups(config: ParallelConfig = ParallelConfig()) -> ReplicaGroups:
    """The trivial replica of one process (tp = pp = 1): no torch.distributed needed."""
    if config.num_gpus != 1:
        raise HydraulisError(f"{config.name} needs {config.num_gpus} processes, not one")
    return ReplicaGroups(
        config=config, ranks=(0,), rank=0, stage=0, tp=TensorParallel(), pp_group=None, replica_group=None,
        prev_rank=None, next_rank=None,
    )
