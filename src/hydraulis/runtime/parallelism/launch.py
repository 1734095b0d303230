"""Process start-up: one process per GPU under torchrun, or N local gloo processes without one.

`init_distributed` reads torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), pins the CUDA device BEFORE any CUDA
tensor or NCCL communicator exists, and picks NCCL on GPUs, gloo otherwise.
`spawn` is the local launcher behind `hydraulis train --nproc N`: it starts N
gloo processes and watches them, so that one rank that fails (an exception,
a signal, a gloo abort without a Python error) ends the whole job with that
rank's error instead of leaving its peers blocked in a collective. The ranks
are forked from a fork server (`processes/rank_server.py`) that imported torch and this
module once: a process that launches many jobs (the profiler's rounds, the
tests) pays once. Each rank takes the launcher's environment of the moment,
as a spawned one did, not the fork server's.
"""

from __future__ import annotations

import datetime
import io
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hydraulis.cost.conditions import cpu_cores
from hydraulis.errors import HydraulisError
from hydraulis.processes import rank_server
from hydraulis.processes.leave import leave
from hydraulis.progress import say
from hydraulis.specs import DTYPE_NAMES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the torch dtype of each of specs.DTYPE_NAMES
assert tuple(DTYPES) == DTYPE_NAMES
PG_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def device_kind(device: str = "auto") -> str:
    """cpu or cuda: what a job asking for `device` (auto, cpu or cuda) trains on here."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(device: str = "auto", timeout: datetime.timedelta = PG_TIMEOUT) -> DistEnv:
    """Join the job described by the environment (a job of one when nothing is set)."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = device_kind(device) == "cuda"
    if use_cuda:
        if not torch.cuda.is_available():
            raise HydraulisError("device cuda was asked for, but torch sees no GPU")
        torch.cuda.set_device(local_rank)  # before any CUDA tensor or NCCL group
        dev, backend = torch.device("cuda", local_rank), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if world > 1:
                raise HydraulisError("MASTER_PORT is not set: start multi-process jobs with torchrun or --nproc")
            os.environ["MASTER_PORT"] = str(free_port())
        kwargs = {"device_id": dev} if use_cuda else {}
        try:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
        except (RuntimeError, dist.DistError) as exc:  # a rank that failed to start: one line, not a C++ trace
            said = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise HydraulisError(
                f"rank {rank} could not join the job's {world} ranks within {timeout.total_seconds():.0f} s "
                f"({said}); a rank that failed during start-up names itself in its own error line"
            ) from None
    global _joined
    _joined = True
    return DistEnv(rank, world, local_rank, dev, backend)


_joined = False  # this process joined a job's process group (init_distributed)


def joined_a_job() -> bool:
    return _joined


def leave_process(code: int) -> None:
    """End a process that joined a job, its output flushed, without finalizing the interpreter.

    Why: torch's native threads (gloo's, the autograd engine's) can outlive `destroy_process_group` and, while
    the interpreter finalizes, release Python objects or take the GIL; the C++ runtime then aborts the
    process ("terminate called without an active exception", SIGABRT) after it trained and saved, and
    torchrun reports the job FAILED. Nothing of the job is left to finalize (every file is closed and
    the group left, see leave_distributed), so the process ends here, as a spawned rank always did (_child).
    """
    leave(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave_distributed() -> None:
    """Every rank meets, then the process group ends: gloo's threads stop before the interpreter does. A rank
    that exits with them alive can abort ("terminate called without an active exception"), and a torchrun
    agent waiting on it hangs."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class RankFailed(HydraulisError):
    """A rank of a local job failed; the message names it and its error, `detail` has its traceback."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


class _ByValue(pickle.Pickler):
    """`fn` and its arguments by value (tensors included), but multiprocessing's own objects (a queue, an
    event), which only travel with the Process: multiprocessing's pickler would send each tensor as a file
    descriptor, and a fork server takes at most 256 of them per process."""

    def __init__(self, file: io.BytesIO, inherited: list[Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.inherited = inherited

    def persistent_id(self, obj: Any) -> int | None:
        if type(obj).__module__.startswith("multiprocessing."):
            self.inherited.append(obj)
            return len(self.inherited) - 1
        return None


def _unpickle(call: bytes, inherited: list[Any]) -> Any:
    unpickler = pickle.Unpickler(io.BytesIO(call))
    unpickler.persistent_load = inherited.__getitem__
    return unpickler.load()


def _child(
    call: bytes, inherited: list[Any], rank: int, world: int, port: int, outdir: str, env: dict[str, str]
) -> None:
    out = Path(outdir)
    os.environ.clear()  # the launcher's environment now, not the fork server's when it started
    os.environ.update(env)
    fn, args = _unpickle(call, inherited)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    try:
        torch.set_num_threads(max(1, cpu_cores() // world))
        result = fn(*args)
        (out / f"{rank}.pkl").write_bytes(pickle.dumps(result))
        leave_distributed()
    except KeyboardInterrupt:
        os._exit(130)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        message = str(exc) if isinstance(exc, HydraulisError) else traceback.format_exc()
        (out / f"{rank}.err").write_text(message)
        os._exit(2 if isinstance(exc, HydraulisError) else 1)
    os._exit(0)


_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out", "timed out")


def _blame(code: int, err: Path) -> int:
    """How likely a failed rank is the cause (lower: more): a signal or a user error, a bug, a lost peer.

    A rank that lost a peer is never the cause, whatever its exit code: one still joining the job when a
    peer failed ends with a user error's code (it could not join) that names the closed connection."""
    if code < 0:
        return 0
    text = err.read_text() if err.exists() else ""
    if any(s in text for s in _PEER_LOST):
        return 3
    return 1 if code == 2 else 2


def _exit_reason(rank: int, code: int) -> str:
    if code < 0:
        return f"rank {rank} died by signal {signal.Signals(-code).name}"
    return f"rank {rank} exited with code {code}"


class _Forward:
    """While the launcher waits: SIGINT or SIGTERM goes on to the ranks as itself (they finish their
    step, save, say which signal stopped them and exit 0); a second one, or ranks still running after
    `grace_s`, ends them at once."""

    def __init__(self, procs: list, grace_s: float) -> None:
        self.procs = procs
        self.grace_s = grace_s
        self.since: float | None = None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame) -> None:
        if self.since is not None:
            raise KeyboardInterrupt
        self.since = time.monotonic()
        for p in self.procs:
            if p.exitcode is None and p.pid is not None:
                os.kill(p.pid, signum)
        if sys.stdout.isatty():  # rank 0's progress bar holds the terminal's line, after the echoed ^C
            print(file=sys.stdout, flush=True)
        say(f"{signal.Signals(signum).name} passed on to the ranks; send it again to stop them at once")

    def overdue(self) -> bool:
        return self.since is not None and time.monotonic() - self.since > self.grace_s

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _start(procs: list) -> None:
    """Start every rank with SIGINT and SIGTERM held. One that came meanwhile ends the started ranks (nothing ran
    yet), then reaches the launcher's own handler. Cut short instead, a start could leave a rank that no one
    ends, unpickling its arguments after the launcher has gone: a traceback on stderr."""
    rank_server.start()  # before the mask: the server, and every rank forked from it, would inherit it
    signals = {signal.SIGINT, signal.SIGTERM}
    held = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        for p in procs:
            p.start()
    except BaseException:
        _end(procs)
        raise
    finally:
        if signals & signal.sigpending():
            _end(procs)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _end(procs: list) -> None:
    """Kill the ranks still running, then reap every started one."""
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.exitcode is None:
            p.kill()
    for p in started:
        p.join(timeout=10)


def spawn(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    poll_s: float = 0.05,
    grace_s: float = 120,
    deadline_s: float | None = None,
) -> list[Any]:
    """fn(*args) on `nproc` local processes (env set as torchrun would); their results in rank order.

    The first rank to fail ends the others; the error names it, with its
    message (a user error) or traceback (a bug). No rank outlives the call,
    nor, with `deadline_s`, the deadline (the one launcher of the job, the
    profiler, the tests and the benchmarks).
    """
    ctx = rank_server.context()
    port = free_port()
    buffer, inherited = io.BytesIO(), []
    _ByValue(buffer, inherited).dump((fn, args))
    call, env = buffer.getvalue(), dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="hydraulis-job-") as outdir:
        procs = [
            ctx.Process(target=_child, args=(call, inherited, r, nproc, port, outdir, env)) for r in range(nproc)
        ]
        _start(procs)
        failed: tuple[int, int] | None = None
        forward = _Forward(procs, grace_s)
        start = time.monotonic()
        try:
            while any(p.exitcode is None for p in procs):
                if forward.overdue():
                    raise KeyboardInterrupt
                if deadline_s is not None and time.monotonic() - start > deadline_s:
                    raise RankFailed(f"the deadline of {deadline_s:.0f} s passed with ranks still running")
                bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if bad:
                    time.sleep(0.2)  # let peers that the failure broke exit too, then pick the cause
                    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    failed = min(bad, key=lambda rc: (_blame(rc[1], Path(outdir) / f"{rc[0]}.err"), rc[0]))
                    break
                time.sleep(poll_s)
            else:
                bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
                failed = min(bad, key=lambda rc: (_blame(rc[1], Path(outdir) / f"{rc[0]}.err"), rc[0])) if bad else None
        finally:
            forward.restore()
            _end(procs)
        if failed is not None:
            rank, code = failed
            err = Path(outdir) / f"{rank}.err"
            detail = err.read_text().strip() if err.exists() else ""
            if code == 130 and not detail:
                raise KeyboardInterrupt
            last = detail.splitlines()[-1] if detail else ""
            reason = _exit_reason(rank, code)
            raise RankFailed(f"{reason}: {last}" if last else reason, detail)
        return [pickle.loads((Path(outdir) / f"{r}.pkl").read_bytes()) for r in range(nproc)]
