"""Run a function over items on the machine's cores, in forked children: the proposal's independent plans.

Proposing a pool plans every sample batch on dozens of candidate deployments and trial pools, each plan
independent of the others and deterministic. Forked children inherit the parent's state as it is (the
planner's memo of plans already made included), so nothing but the items' results travels, pickled through
a file each. The results are the ones a loop in this process gives, in the items' order: a child runs the
same code on the same inputs.

Serial where fork is not available or not safe to rely on (not Linux), with one usable core, or where the
environment says so (`HYDRAULIS_WORKERS=1`). A child that fails raises its exception here; one that dies
without a word (killed, out of memory) is an error naming its exit status, and no partial result is used.
"""

from __future__ import annotations

import itertools
import os
import pickle
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

from hydraulis.errors import HydraulisError

T = TypeVar("T")
R = TypeVar("R")
WORKERS_ENV = "HYDRAULIS_WORKERS"


def _wanted() -> int | None:
    """`HYDRAULIS_WORKERS` where set (1: everything in this process), checked; else None."""
    text = os.environ.get(WORKERS_ENV, "").strip()
    if not text:
        return None
    try:
        wanted = int(text)
    except ValueError:
        raise HydraulisError(f"{WORKERS_ENV}={text!r} is not a whole number; set it to 1 or more") from None
    if wanted < 1:
        raise HydraulisError(f"{WORKERS_ENV}={wanted}: set it to 1 (no children) or more")
    return wanted


def forks_allowed() -> bool:
    """Whether work may go to a forked child at all: fork on Linux, unless `HYDRAULIS_WORKERS=1` keeps it here."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and _wanted() != 1


def usable_workers(per_rank: bool = True) -> int:
    """Cores this process may run on, or `HYDRAULIS_WORKERS` where set (1: everything in this process). Under
    torchrun every rank of a node prepares the job (a pool = "auto" proposes it), so each takes its share
    (`per_rank`); a corpus build takes them all (the other ranks wait for it)."""
    wanted = _wanted()
    if wanted is not None:
        return wanted
    if not sys.platform.startswith("linux"):
        return 1
    local_ranks = os.environ.get("LOCAL_WORLD_SIZE", "1") if per_rank else "1"
    return max(1, len(os.sched_getaffinity(0)) // max(1, int(local_ranks) if local_ranks.isdigit() else 1))


def fan_out(
    fn: Callable[[T], R], items: Sequence[T], workers: int | None = None, memo: dict | None = None
) -> list[R]:
    """`[fn(x) for x in items]`, the items dealt in turn to up to `workers` forked children (default:
    `usable_workers()`). `memo`: a dict the work adds to (the planner's memo, nested dicts merged); what the
    children add comes back into it, as if the work had run here."""
    items = list(items)
    workers = min(usable_workers() if workers is None else workers, len(items))
    if workers <= 1 or not hasattr(os, "fork"):
        return [fn(x) for x in items]
    with tempfile.TemporaryDirectory(prefix="hydraulis-fan-out-") as folder:
        children = []
        for w in range(workers):
            path = os.path.join(folder, f"{w}.pickle")
            with warnings.catch_warnings():  # Python 3.12+ warns of fork beside threads (a progress bar's): the
                warnings.simplefilter("ignore", DeprecationWarning)  # child only plans and writes its own file
                pid = os.fork()
            if pid == 0:  # the child: its share, its results to its file, and out without the parent's exit hooks
                _child(fn, items[w::workers], path, memo)
            children.append((pid, path))
        collected = [_collect(pid, path) for pid, path in children]  # every child waited for, then any error
    for found in collected:
        if isinstance(found, BaseException):
            raise found
    out: list[R] = [None] * len(items)  # type: ignore[list-item]
    for w, (share, added) in enumerate(collected):  # type: ignore[misc]
        out[w::workers] = share
        if memo is not None:
            _merge(memo, added)
    return out


def fan_out_grid(
    fn: Callable[[T, range], list[R]], rows: Sequence[T], count: int, workers: int | None = None,
    memo: dict | None = None,
) -> list[list[R]]:
    """`[fn(x, range(count)) for x in rows]` (fn gives a result per index of its range), on more cores than there
    are rows: each row's range cut into as many parts as it takes to give each of `workers` (default
    `usable_workers()`) an item, one part where the rows alone do (the proposal's 4 sample batches, each planned on
    dozens of candidates, kept 16 cores 4 busy)."""
    rows = list(rows)
    workers = usable_workers() if workers is None else workers
    parts = max(1, min(count, -(-workers // max(len(rows), 1))))
    cuts = [round(count * k / parts) for k in range(parts + 1)]
    items = [(r, range(a, b)) for a, b in itertools.pairwise(cuts) for r in range(len(rows))]
    found = fan_out(lambda item: fn(rows[item[0]], item[1]), items, workers=workers, memo=memo)
    out: list[list[R]] = [[] for _ in rows]
    for (r, _), results in zip(items, found, strict=True):
        out[r].extend(results)  # the parts in order
    return out


def _keys(memo: dict) -> dict:
    """The memo's keys, nested dicts' too."""
    return {k: _keys(v) if isinstance(v, dict) else None for k, v in memo.items()}


def _added(memo: dict, keys: dict) -> dict:
    """What the memo holds beyond `keys` (`_keys` of it before)."""
    out = {}
    for k, v in memo.items():
        if k not in keys:
            out[k] = v
        elif isinstance(v, dict) and keys[k] is not None and (inner := _added(v, keys[k])):
            out[k] = inner
    return out


def _merge(memo: dict, added: dict) -> None:
    for k, v in added.items():
        if isinstance(v, dict) and isinstance(memo.get(k), dict):
            _merge(memo[k], v)
        else:
            memo[k] = v


def _child(fn: Callable[[T], R], share: Sequence[T], path: str, memo: dict | None) -> None:
    code = 0
    try:
        try:
            keys = _keys(memo or {})
            results = [fn(x) for x in share]
            found: object = (results, _added(memo, keys) if memo is not None else {})
        except BaseException as exc:  # noqa: BLE001 - the parent raises it
            found = exc
        try:
            data = pickle.dumps(found, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - an exception that does not pickle: its text does
            data = pickle.dumps(HydraulisError(f"a planning worker failed: {found!r} ({exc})"))
        with open(path, "wb") as f:
            f.write(data)
    except BaseException:  # noqa: BLE001 - nothing to report it to but the exit status
        code = 1
    finally:
        os._exit(code)


def _collect(pid: int, path: str) -> tuple[list, dict] | BaseException:
    """A child's results and memo entries, or the error it raised (or its death's)."""
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0 or not os.path.exists(path):
        return HydraulisError(f"a forked planning worker (pid {pid}) died with exit status {code} and no result; "
                              f"set {WORKERS_ENV}=1 to plan in this process only")
    with open(path, "rb") as f:
        return pickle.load(f)
