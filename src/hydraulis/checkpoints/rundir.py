"""The run directory must be one directory for every rank: checked at start-up, before any training.

Every rank writes a token (`.ranks-NONCE/rank-R`, NONCE rank 0's, so an old
run's tokens never count) into the run directory; rank 0 then checks that it
sees every rank's. A node with a directory of its own (a local path on a
multi-node job) would otherwise write checkpoint shards that rank 0 never
sees. Every rank learns the outcome, raises the same one line, and removes
its token.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path

import torch.distributed as dist

from hydraulis.errors import HydraulisError


def _all(obj: object, world: int, group: dist.ProcessGroup | None) -> list:
    out: list = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def check_shared_run_dir(out: Path, rank: int, world: int, group: dist.ProcessGroup | None = None) -> None:
    """Raise (on every rank) when rank 0 cannot see a token that another rank wrote into `out`."""
    if world == 1:
        return
    nonce = _all(uuid.uuid4().hex if rank == 0 else None, world, group)[0]
    tokens = out / f".ranks-{nonce}"
    created = not out.exists()
    try:
        tokens.mkdir(parents=True, exist_ok=True)
        (tokens / f"rank-{rank}").write_text(f"{os.uname().nodename} {os.getpid()}\n")
        written = None
    except OSError as exc:
        written = f"rank {rank} cannot write into the run directory {out}: {exc.strerror or exc}"
    errors = _all(written, world, group)  # also a barrier: every token is written before rank 0 looks
    error = next((e for e in errors if e is not None), None)  # the same on every rank
    if error is None:
        unseen = [r for r in range(world) if not (tokens / f"rank-{r}").is_file()] if rank == 0 else []
        mine = None
        if unseen:
            mine = (
                f"the run directory {out} is not shared by all nodes (rank {unseen[0]} cannot be seen from rank 0); "
                "use a shared file system path for [train] out"
            )
        error = _all(mine, world, group)[0]
    with contextlib.suppress(OSError):
        (tokens / f"rank-{rank}").unlink(missing_ok=True)
    _all(None, world, group)  # every token removed before the directory goes
    shutil.rmtree(tokens, ignore_errors=True)
    if error is not None:
        if created:  # a node's own directory, made only for its token: nothing is left behind
            with contextlib.suppress(OSError):
                out.rmdir()
        raise HydraulisError(error)
