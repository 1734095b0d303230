"""A planner in a child process: rank 0 plans the next batch there while the training loop computes.

Why not a thread: the planner is pure Python and numpy for seconds per batch, and a thread holds the
interpreter's lock (the GIL) for all of it. The training loop needs that lock after every wait on the device or
a peer, and gets it back only when the planner's thread gives it up, up to a switch interval (5 ms) later: a
launch loop that waits often ran 2.8x slower beside the 256-GPU planner in a thread, 1.4x at a 0.5 ms interval,
and 1.00x beside it in a child (`benchmarks/planner_gil.py`), which has its own interpreter.

The child is forked at the first plan, from the planner as it is then, and keeps its caches warm from batch to
batch. Each batch goes to it and its schedule comes back, with what the plan recorded on the planner (the
deployments that missed it, its outlook), so the planner here keeps the run's records as if it had planned. A
refit model (the planner's `with_cost`) goes to the child before the next plan. The child ignores Ctrl-C (its
parent handles it) and leaves when its parent closes the pipe or dies.
"""

from __future__ import annotations

import os
import signal
import warnings
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from hydraulis.errors import HydraulisError
from hydraulis.planner.phases import PhasedPlanner
from hydraulis.planner.schedule import Schedule
from hydraulis.processes.fan_out import WORKERS_ENV


class PlanServer:
    """`planner.schedule` in a forked child (one request at a time: the caller serializes them)."""

    def __init__(self) -> None:
        self._pid: int | None = None
        self._conn: Connection | None = None
        self._cost = None  # the cost model the child plans with

    def schedule(self, planner: PhasedPlanner, lengths: np.ndarray, step: int) -> Schedule:
        """The child's schedule of the batch, `planner`'s records (missed deployments, outlook) added to as if it
        had planned; the child is forked from it at the first call and takes its cost model where it changed (a
        refit, `Planner.with_cost`). A planning error is raised here as the child raised it; a child that died is
        a HydraulisError naming its exit status."""
        if self._conn is None:
            self._start(planner)
        if planner.cost is not self._cost:
            self._call(("cost", planner.cost))
            self._cost = planner.cost
        schedule, missed, outlook = self._call(("schedule", np.asarray(lengths), step))
        planner.missed.update(missed)
        if outlook is not None:
            planner.outlook[step] = outlook
        return schedule

    def close(self) -> None:
        """End the child (it leaves on the closed pipe) and reap it."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._pid is not None:
            os.waitpid(self._pid, 0)
            self._pid = None

    def _start(self, planner: PhasedPlanner) -> None:
        here, there = Pipe()
        with warnings.catch_warnings():  # Python 3.12+ warns of fork beside threads: the child only plans
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            here.close()
            _serve(planner, there)
        there.close()
        self._pid, self._conn, self._cost = pid, here, planner.cost

    def _call(self, request: tuple) -> Any:
        assert self._conn is not None
        try:
            self._conn.send(request)
            ok, value = self._conn.recv()
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


def _serve(planner: PhasedPlanner, conn: Connection) -> None:
    """The child: plan each batch asked for until the parent closes the pipe; out without its exit hooks and without
    flushing (`os._exit`, not `processes.leave`): its stdio buffers are the parent's, copied at the fork, and
    flushing them would write the parent's pending output twice."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    try:
        while True:
            try:
                op, *args = conn.recv()
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
            conn.send(reply)
    except BaseException:  # noqa: BLE001 - nothing to report it to but the exit status
        code = 1
    finally:
        os._exit(code)
