"""The trainer's planner in a child process (runtime/plan_server.py) plans as the planner does in this one, keeps
the planner's records here, follows a refit model, raises the planner's errors and names a child's death."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from hydraulis.cost import load_cost_model
from hydraulis.errors import HydraulisError, OverlongError
from hydraulis.parallel import Deployment
from hydraulis.planner.phases import PhasedPlanner
from hydraulis.planner.plan import Schedule
from hydraulis.runtime.plan_server import PlanServer
from hydraulis.specs import ClusterSpec

CLUSTER = ClusterSpec(16)
COST = load_cost_model("llama-7b@a800-80g")
POOL = tuple(Deployment.parse(t, CLUSTER) for t in ("4x(tp4,pp1)", "8x(tp2,pp1)", "2x(tp4,pp2)"))


def planner(cost=COST) -> PhasedPlanner:
    return PhasedPlanner(cost, CLUSTER.num_gpus, POOL)


def same(a: Schedule, b: Schedule) -> bool:
    """The same schedule and times (the planning times aside)."""
    def facts(s: Schedule) -> list:
        return [s.indices, s.iteration_time_s, *[(str(p.deployment), [r.micro_batches for r in p.replicas],
                                                  p.predicted_time_s, p.replica_predicted_s) for p in s.phases]]
    return facts(a) == facts(b)


def batch(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.integers(100, 2000, 60), rng.integers(8000, 16000, 1 + seed % 3)])


def test_a_child_plans_as_this_process_and_the_records_stay_here():
    here, there = planner(), planner()
    server = PlanServer()
    try:
        for step in range(3):
            lengths = batch(step)
            mine, theirs = here.schedule(lengths, step), server.schedule(there, lengths, step)
            assert same(theirs, mine)
        assert there.outlook == here.outlook and len(there.outlook) == 3
        assert there.missed == here.missed
        assert server._pid is not None and os.getpid() != server._pid  # planned elsewhere
    finally:
        server.close()
    assert server._pid is None


def test_a_refit_model_goes_to_the_child_before_the_next_plan():
    refit = COST.with_recompute(POOL[0].configs)  # another model (a config slower), as a refit hands over
    here, there = planner(), planner()
    server = PlanServer()
    try:
        server.schedule(there, batch(0), 0)
        theirs = server.schedule(there.with_cost(refit), batch(1), 1)
        assert same(theirs, here.with_cost(refit).schedule(batch(1), 1))
        assert not same(theirs, here.schedule(batch(1), 1))  # not vacuous: the old model plans otherwise
    finally:
        server.close()


def test_the_planners_error_is_raised_here_and_the_child_plans_on():
    server, there = PlanServer(), planner()
    try:
        with pytest.raises(OverlongError) as raised:
            server.schedule(there, np.array([100, 10**7]), 0)
        with pytest.raises(OverlongError) as direct:
            planner().schedule(np.array([100, 10**7]), 0)
        assert str(raised.value) == str(direct.value)
        assert server.schedule(there, batch(0), 1).iteration_time_s > 0
    finally:
        server.close()


def test_a_child_that_died_is_one_error_naming_its_exit():
    server, there = PlanServer(), planner()
    server.schedule(there, batch(0), 0)
    os.kill(server._pid, signal.SIGKILL)
    with pytest.raises(HydraulisError, match=r"the planning process died \(exit status -9.*HYDRAULIS_WORKERS=1"):
        server.schedule(there, batch(1), 1)
    server.close()


def test_a_child_forked_from_a_planning_thread_plans_as_from_the_main_one():
    """The trainer's feed calls it from its planner thread (runtime/plan_feed.py): the child starts from there."""
    from concurrent.futures import ThreadPoolExecutor

    server = PlanServer()
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            theirs = pool.submit(server.schedule, planner(), batch(2), 0).result()
        assert same(theirs, planner().schedule(batch(2), 0))
    finally:
        server.close()
