"""A function over a stream of items in forked worker processes, results in the items' order, memory bounded.

A corpus build reads its input as a stream (a 100 GB jsonl is never a list) and tokenizes it a chunk at a
time. `stream_map` deals the chunks to a pool of forked workers as they come and yields the results in the
input's order, with at most `ahead` chunks per worker in flight, so memory is bounded by the workers' chunks,
not by the input. (`fan_out.py` is the planner's: a list of items known up front, its results and memo back
in one piece.)

The workers are forked, so the function and what it closes over (a tokenizer, an output directory) are
inherited, not pickled: only the items and the results travel. Each worker dies with its parent (Linux's
parent-death signal: a SIGKILLed build leaves no orphan working on) and ignores SIGINT (the parent handles
Ctrl-C and ends them). One worker, or a stream of a single item, runs in this process. A worker that
dies without a result is an error here (concurrent.futures notices), never a wait for ever.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import chain, islice
from typing import Any, TypeVar

from hydraulis.errors import HydraulisError

T = TypeVar("T")
R = TypeVar("R")

_FN: list[Callable[[Any], Any]] = []  # the function of the pool being started, inherited by its forked workers
PR_SET_PDEATHSIG = 1


def stream_map(fn: Callable[[T], R], items: Iterable[T], workers: int, ahead: int = 2) -> Iterator[R]:
    """`map(fn, items)` on up to `workers` forked processes, in order, at most `ahead * workers` items in
    flight. Use it in a `with contextlib.closing(...)`: closing it ends the workers (those busy finish their
    item first). A worker that dies (killed, out of memory) is a WorkerLost."""
    stream = iter(items)
    first = list(islice(stream, 2))
    if workers <= 1 or len(first) < 2 or not hasattr(os, "fork"):
        yield from map(fn, chain(first, stream))
        return
    _FN[:] = [fn]
    context = multiprocessing.get_context("fork")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_start, initargs=(os.getpid(),))
    try:
        pending: deque[Future[Any]] = deque()
        with warnings.catch_warnings():  # Python 3.12+ warns of fork beside threads (a progress bar's): the
            warnings.simplefilter("ignore", DeprecationWarning)  # workers only run `fn` and write their own files
            pending.append(pool.submit(_call, first[0]))  # forks the workers (all of them, with fork)
        for item in chain(first[1:], stream):
            pending.append(pool.submit(_call, item))
            while len(pending) >= ahead * workers:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _FN.clear()


class WorkerLost(HydraulisError):
    """A worker process died without a result (killed, out of memory): not the input's fault."""


def _result(future: Future[R]) -> R:
    try:
        return future.result()
    except BrokenProcessPool:
        raise WorkerLost(
            "a worker process died without a result (killed, or out of memory?); run again with fewer workers"
        ) from None


def _call(item: Any) -> Any:
    return _FN[0](item)


def _worker_start(parent: int) -> None:
    """Die with the parent (even a SIGKILLed one), leave Ctrl-C to it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the signal was asked for
        os._exit(1)
    # A progress bar's thread may have held its console's lock at the fork: a write through the inherited
    # wrappers would wait for it forever; the plain streams cannot.
    sys.stdout = sys.__stdout__
    sys.stderr = sys.__stderr__
