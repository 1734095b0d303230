"""Functions the launcher tests run on every rank (importable by spawned children)."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from hydraulis.errors import HydraulisError
from hydraulis.runtime.parallelism.launch import init_distributed


def fails_on(rank_to_fail: int, how: str) -> int:
    """Every rank joins a collective; one rank fails first, leaving the others blocked in it."""
    env = init_distributed("cpu")
    if env.rank == rank_to_fail:
        if how == "error":
            raise HydraulisError("the data of this rank is bad")
        if how == "bug":
            raise ZeroDivisionError("a bug")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))  # never completes: the failed rank does not join
    return env.rank


def ranks() -> tuple[int, int]:
    env = init_distributed("cpu")
    t = torch.tensor([float(env.rank)])
    dist.all_reduce(t)
    return env.rank, int(t)
