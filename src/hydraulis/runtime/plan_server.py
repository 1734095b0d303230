"""A planner in a child process: rank 0 plans the next batch there while the training loop computes.

Why not a thread: the planner is pure Python and numpy for seconds per batch, and a thread holds the
interpreter's lock (the GIL) for all of it. The training loop needs that lock after every wait on the device or
a peer, and gets it back only when the planner's thread gives it up, up to a switch interval (5 ms) later: a
launch loop that waits often ran 2.8x slower beside the 256-GPU planner in a thread, 1.4x at a 0.5 ms interval,
and 1.00x beside it in a child (`benchmarks/planner_gil.py`), which has its own interpreter.

The child is forked at the first plan, from the planner as it is then, and keeps its caches warm from batch to
batch. Each batch goes to it and its schedule comes back, with what the plan recorded on the planner (the
deployments that missed it, its outlook), so the planner here keeps the run's records as if it had planned. A
refit model (`use`) goes to the child before the next plan. The child ignores Ctrl-C (its parent handles it)
and leaves when its parent closes the socket or dies.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import sys
import warnings
from typing import Any

import numpy as np

from hydraulis.errors import HydraulisError
from hydraulis.planner.phases import PhasedPlanner
from hydraulis.planner.schedule import Schedule
from hydraulis.processes.fan_out import WORKERS_ENV

_SIZE = struct.Struct("<Q")


def available() -> bool:
    """Whether plans may go to a child: fork on Linux, unless `HYDRAULIS_WORKERS=1` keeps them in the process."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and os.environ.get(WORKERS_ENV, "").strip() != "1"


class PlanServer:
    """`planner.schedule` in a forked child (one request at a time: the caller serializes them)."""

    def __init__(self, planner: PhasedPlanner) -> None:
        self.planner = planner  # the records' owner here; the child plans on its own copy
        self._pid: int | None = None
        self._sock: socket.socket | None = None
        self._cost = planner.cost

    def use(self, planner: PhasedPlanner) -> None:
        """Plan with this planner's cost model from the next batch (`Planner.with_cost`: the same records)."""
        self.planner = planner

    def schedule(self, lengths: np.ndarray, step: int) -> Schedule:
        """The child's schedule of the batch; its records added to the planner here. A planning error is raised
        here as the child raised it; a child that died is a HydraulisError naming its exit status."""
        if self._sock is None:
            self._start()
        if self.planner.cost is not self._cost:
            self._cost = self.planner.cost
            self._call(("cost", self._cost))
        schedule, missed, outlook = self._call(("schedule", np.asarray(lengths), step))
        self.planner.missed.update(missed)
        if outlook is not None:
            self.planner.outlook[step] = outlook
        return schedule

    def close(self) -> None:
        """End the child (it leaves on the closed socket) and reap it."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._pid is not None:
            os.waitpid(self._pid, 0)
            self._pid = None

    def _start(self) -> None:
        here, there = socket.socketpair()
        with warnings.catch_warnings():  # Python 3.12+ warns of fork beside threads: the child only plans
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            here.close()
            _serve(self.planner, there)
        there.close()
        self._pid, self._sock = pid, here

    def _call(self, request: tuple) -> Any:
        assert self._sock is not None
        try:
            _send(self._sock, request)
            ok, value = _receive(self._sock)
        except (OSError, EOFError) as exc:
            _, status = os.waitpid(self._pid, 0) if self._pid is not None else (0, 0)
            self._pid = None
            self.close()
            raise HydraulisError(f"the planning process died (exit status {os.waitstatus_to_exitcode(status)}, "
                                 f"{exc or 'no reply'}); set {WORKERS_ENV}=1 to plan in the training process"
                                 ) from None
        if not ok:
            raise value
        return value


def _serve(planner: PhasedPlanner, sock: socket.socket) -> None:
    """The child: plan each batch asked for until the parent closes the socket; out without its exit hooks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    try:
        while True:
            try:
                op, *args = _receive(sock)
            except EOFError:
                break
            try:
                if op == "cost":
                    planner = planner.with_cost(args[0])
                    reply: tuple = (True, None)
                else:
                    lengths, step = args
                    schedule = planner.schedule(lengths, step)
                    reply = (True, (schedule, set(planner.missed), planner.outlook.get(step)))
            except HydraulisError as exc:
                reply = (False, exc)
            _send(sock, reply)
    except BaseException:  # noqa: BLE001 - nothing to report it to but the exit status
        code = 1
    finally:
        os._exit(code)


def _send(sock: socket.socket, value: object) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_SIZE.pack(len(data)) + data)


def _receive(sock: socket.socket) -> Any:
    size = _SIZE.unpack(_exactly(sock, _SIZE.size))[0]
    return pickle.loads(_exactly(sock, size))


def _exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other end closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
