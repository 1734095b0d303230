"""Process-group timeouts: a long one while the job starts and takes its first step, `[train] timeout_s` after.

The reduce runs on the world group, so a fast replica waits inside it for
the slowest one; a timeout shorter than an iteration aborts the job. The
first step builds groups, allocates and warms kernels, so it gets
FIRST_STEP_FACTOR times the steady timeout (torchtitan's init and train
timeouts). After it, every rank meets at a barrier and every group of the
job is set to the steady timeout.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable

import torch.distributed as dist
from torch.distributed import distributed_c10d

from hydraulis.limits import DEFAULT_TIMEOUT_S

__all__ = ["DEFAULT_TIMEOUT_S", "FIRST_STEP_FACTOR", "first_step_timeout", "settle_timeouts"]

FIRST_STEP_FACTOR = 3


def first_step_timeout(timeout_s: float) -> datetime.timedelta:
    """The timeout of every group until the first step is done."""
    return datetime.timedelta(seconds=FIRST_STEP_FACTOR * timeout_s)


def settle_timeouts(timeout_s: float, groups: Iterable[dist.ProcessGroup | None]) -> None:
    """After the first step: the steady timeout on the world group and on `groups` (a collective of the job)."""
    if not dist.is_initialized() or not hasattr(distributed_c10d, "_set_pg_timeout"):
        return
    dist.barrier()  # no rank may still be inside the first step's collectives under the long timeout
    timeout = datetime.timedelta(seconds=timeout_s)
    distributed_c10d._set_pg_timeout(timeout, None)
    for group in groups:
        if group is not None:
            distributed_c10d._set_pg_timeout(timeout, group)
