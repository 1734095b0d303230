"""The trainer's plans: drawn and planned one step ahead, broadcast from rank 0, decoded on every rank.

Every rank draws the same batches from the sampler's seed without
communicating. Rank 0 plans each one while the previous iteration computes:
a background thread hands it to a child process that plans
(runtime/plan_server.py: a thread would hold the GIL the training loop
needs after every wait), encodes the schedule as a compact int64 vector and
broadcasts it on a CPU group (NCCL cannot broadcast host memory); only
planning time that compute did not hide is waited for. Where
CPU ranks fill the cores (`ahead` off: cost/conditions.py's `spare_core`),
rank 0 plans a batch when its step begins, while the other ranks wait at the
broadcast: beside compute the planner took the ranks' cores, and every step
ran slower than its profile (timed without a planner) predicted.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hydraulis.cost.model import CostModel
from hydraulis.data.sampler import GlobalBatch, SamplerState, TokenBudgetSampler
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment
from hydraulis.planner.phases import PhasedPlanner
from hydraulis.planner.plan import Schedule, decode_schedule, encode_schedule
from hydraulis.processes.fan_out import forks_allowed
from hydraulis.runtime.plan_server import PlanServer


class PlanFeed:
    """The next batch and its schedule, one step ahead. `step` is the step the trainer runs next (it advances it
    after each iteration: a plan made by hand runs a step too); the feed and the optimizer are what a checkpoint
    saves."""

    def __init__(
        self, sampler: TokenBudgetSampler, pool: tuple[Deployment, ...], cost: CostModel, rank: int, world: int,
        control: dist.ProcessGroup | None, ahead: bool = True, zero_bubble: bool = False,
    ) -> None:
        self.sampler = sampler
        self.ahead = ahead  # plan the next batch while this one computes (off: when its step begins)
        self.pool = pool
        self.world = world
        self.control = control
        self.planner = PhasedPlanner(cost, world, pool, zero_bubble=zero_bubble) if rank == 0 else None
        # beside compute, in a child process: a planning thread would hold the GIL the training loop waits for
        self._server = PlanServer() if self.planner is not None and ahead and forks_allowed() else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planner") if rank == 0 else None
        self.step = 0
        self.last: GlobalBatch | None = None  # the batch last handed out (training/run.py counts a mixture's sources)
        self._pending: tuple[GlobalBatch, Future | None] | None = None
        self._planning = threading.Lock()  # held while the planner's thread plans

    def _plan(self, lengths: np.ndarray, step: int) -> np.ndarray:
        """Rank 0's schedule of a batch, encoded (in the planner's thread)."""
        with self._planning:
            schedule = self.planner.schedule(lengths, step) if self._server is None else \
                self._server.schedule(self.planner, lengths, step)
            return encode_schedule(schedule, self.pool)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No planning inside: a plan in flight finishes first, the next waits.

        Why: a CPU census of live tensors (runtime/metering/memory_meter.live_tensor_bytes) holds every object of the
        process, and a tuple the planner's thread was building from an iterator then had two references when it
        grew: CPython raises "SystemError: bad argument to internal function" in the planner."""
        with self._planning:
            yield

    def _draw(self) -> tuple[GlobalBatch, Future | None]:
        """The next batch (every rank), its planning started in the background (rank 0)."""
        batch = self.sampler.next_batch()
        future = None if self._executor is None else self._executor.submit(self._plan, batch.lengths, self.step)
        return batch, future

    def next(self) -> tuple[GlobalBatch, Schedule, float]:
        """The batch of `step`, its schedule and the seconds waited for it; the next batch's planning starts."""
        batch, future = self._pending or self._draw()
        waited = time.perf_counter()
        payload = None
        if future is not None:
            try:
                payload = future.result()
            except HydraulisError as exc:
                self.broadcast(None)
                raise HydraulisError(f"planning step {self.step}: {exc}") from None
        waited = time.perf_counter() - waited
        data = self.broadcast(payload)
        if data is None:
            raise HydraulisError(f"rank 0 could not plan step {self.step}")
        schedule = decode_schedule(data, self.step, batch.lengths, self.pool)
        self._pending = self._draw() if self.ahead else None  # plan the next batch while this one computes
        self.last = batch
        return batch, schedule, waited

    def broadcast(self, payload: np.ndarray | None) -> np.ndarray | None:
        """Rank 0's payload on every rank: its length first (-1: rank 0 failed), then the values."""
        if self.world == 1:
            return payload
        size = torch.tensor([-1 if payload is None else len(payload)], dtype=torch.int64)
        dist.broadcast(size, 0, group=self.control)
        if int(size) < 0:
            return None
        data = torch.from_numpy(payload) if payload is not None else torch.empty(int(size), dtype=torch.int64)
        dist.broadcast(data, 0, group=self.control)
        return data.numpy()

    # -- checkpoints and the online refit ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The next step, where its batch starts (the sampler has already drawn one ahead) and, on rank 0, the
        pool deployments that could not hold some batch so far (a resumed run's comparison leaves them out)."""
        position = self._pending[0].state if self._pending is not None else self.sampler.state
        # A copy (one C call): the planner's thread may be adding to the set while a checkpoint saves.
        missed = [] if self.planner is None else sorted(str(self.pool[k]) for k in self.planner.missed.copy())
        return {"step": self.step, "sampler": position, "missed": missed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.restore(state["step"], state["sampler"])
        if self.planner is not None:  # the texts of this pool's deployments (a resume may change the pool)
            missed = set(state.get("missed", ()))
            self.planner.missed.update(k for k, d in enumerate(self.pool) if str(d) in missed)

    def restore(self, step: int, position: SamplerState) -> None:
        """Continue at `step` with the batch at `position`: a batch drawn ahead is dropped."""
        self._drop()
        self.sampler.state = position
        self.step = step

    def _drop(self) -> None:
        if self._pending is not None and self._pending[1] is not None:
            self._pending[1].cancel()  # a plan already running finishes; its result is never read
        self._pending = None

    def use_cost(self, cost: CostModel) -> None:
        """Plan (rank 0) with `cost` from the next step: the online refit's model.

        The batch already being planned with the old model is planned again: a refit takes effect at the next
        step, as in a run resumed there (its checkpoint keeps the refit), so both plan the same."""
        if self.planner is None:
            return
        self.planner = self.planner.with_cost(cost)  # the same records: a plan in flight adds its step to them
        if self._pending is not None and self._pending[1] is not None:
            batch, future = self._pending
            future.cancel()  # if it already runs, it finishes; its result is never read
            self._pending = (batch, self._executor.submit(self._plan, batch.lengths, self.step))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        if self._server is not None:
            self._server.close()
