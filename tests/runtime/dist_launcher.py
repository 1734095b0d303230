"""Run a function on N gloo processes and fail fast.

A gloo mismatch can abort a rank without a Python exception, and a rank
that raises leaves its peers blocked in a collective. So the parent polls
its children: the first non-zero exit code (or death by signal) kills the
others and fails the test with every rank's traceback; a deadline backs up
the process-group timeout. Results come back through files.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

PG_TIMEOUT_S = 30


class WorkerFailed(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, outdir: str, args: tuple) -> None:
    out = Path(outdir)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
        result = fn(rank, world, *args)
        (out / f"{rank}.pkl").write_bytes(pickle.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (out / f"{rank}.err").write_text(traceback.format_exc())
        os._exit(1)  # do not wait for peers in a collective or in atexit handlers
    os._exit(0)


def _describe_exits(procs: list) -> str:
    parts = []
    for r, p in enumerate(procs):
        if p.exitcode is not None and p.exitcode < 0:
            parts.append(f"rank {r} died by signal {signal.Signals(-p.exitcode).name}")
        elif p.exitcode:
            parts.append(f"rank {r} exited with code {p.exitcode}")
    return "; ".join(parts)


def run_workers(fn: Callable[..., Any], world: int, *args: Any, deadline_s: float = 120) -> list[Any]:
    """fn(rank, world, *args) on `world` processes; returns their results in rank order."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="hydraulis-dist-") as outdir:
        procs = [ctx.Process(target=_child, args=(fn, r, world, port, outdir, args), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        start = time.monotonic()
        failure = None
        try:
            while any(p.exitcode is None for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs):
                    time.sleep(0.2)  # let a peer that saw the failure exit too, to report it
                    failure = _describe_exits(procs)
                    break
                if time.monotonic() - start > deadline_s:
                    failure = f"deadline of {deadline_s:.0f} s passed"
                    break
                time.sleep(0.05)
            else:
                if any(p.exitcode != 0 for p in procs):
                    failure = _describe_exits(procs)
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
            for p in procs:
                p.join(timeout=10)
        errors = {r: (Path(outdir) / f"{r}.err") for r in range(world)}
        if failure is not None:
            details = "\n".join(f"--- rank {r}:\n{e.read_text()}" for r, e in errors.items() if e.exists())
            raise WorkerFailed(f"{failure}\n{details}")
        return [pickle.loads((Path(outdir) / f"{r}.pkl").read_bytes()) for r in range(world)]
