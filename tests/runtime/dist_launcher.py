"""Run a function on N gloo processes and fail fast: the runtime's own launcher, `runtime.parallelism.launch.spawn`.

A gloo mismatch can abort a rank without a Python exception, and a rank
that raises leaves its peers blocked in a collective. `spawn` polls its
children: the first failure ends the others and names the rank that caused
it; the deadline backs up the process-group timeout.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

from hydraulis.runtime.parallelism.launch import RankFailed, spawn

PG_TIMEOUT_S = 30


class WorkerFailed(AssertionError):
    pass


def _rank(fn: Callable[..., Any], args: tuple) -> Any:
    """In each child: one thread, a gloo group of the world `spawn` set up, then fn(rank, world, *args)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    return fn(rank, world, *args)


def run_workers(fn: Callable[..., Any], world: int, *args: Any, deadline_s: float = 120) -> list[Any]:
    """fn(rank, world, *args) on `world` processes; returns their results in rank order."""
    try:
        return spawn(_rank, world, fn, args, deadline_s=deadline_s)
    except RankFailed as exc:
        raise WorkerFailed(f"{exc}\n{exc.detail}") from None
