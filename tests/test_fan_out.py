"""fan_out: the proposal's plans on the machine's cores, in forked children, with a loop's results."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hydraulis.errors import HydraulisError
from hydraulis.processes.fan_out import WORKERS_ENV, fan_out, forks_allowed, usable_workers


def _square_noting(memo: dict, x: int) -> int:
    memo[("square", x)] = x * x
    memo.setdefault("later", {})[x] = -x
    return x * x


def test_results_come_back_in_order_and_the_childrens_memo_entries_with_them():
    memo: dict = {"known": 1, "later": {0: 0}}
    out = fan_out(lambda x: _square_noting(memo, x), range(7), workers=3, memo=memo)
    assert out == [x * x for x in range(7)]
    assert memo == {"known": 1, "later": {x: -x for x in range(7)}, **{("square", x): x * x for x in range(7)}}


def _fails(x: int) -> int:
    if x == 3:
        raise HydraulisError(f"item {x} is bad")
    return x


def _dies(x: int) -> int:
    if x == 1:
        os._exit(7)  # a worker killed or out of memory says nothing
    return x


def test_a_childs_error_is_raised_here_and_a_silent_death_named():
    with pytest.raises(HydraulisError, match="item 3 is bad"):
        fan_out(_fails, range(6), workers=2)
    with pytest.raises(HydraulisError, match="exit status 7"):
        fan_out(_dies, range(4), workers=2)


def test_the_environment_sets_the_workers_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.setenv(WORKERS_ENV, "1")
    assert usable_workers() == 1 and not forks_allowed()  # the trainer's planner stays in the process too
    assert fan_out(lambda _: os.getpid(), range(3)) == [os.getpid()] * 3  # in this process
    monkeypatch.delenv(WORKERS_ENV)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * len(os.sched_getaffinity(0))))  # torchrun's ranks of a node
    assert usable_workers() == 1 and forks_allowed()  # one core each, but a child may still plan beside a rank
    monkeypatch.setenv(WORKERS_ENV, "two")
    for read in (usable_workers, forks_allowed):
        with pytest.raises(HydraulisError, match="HYDRAULIS_WORKERS='two'"):
            read()
    monkeypatch.setenv(WORKERS_ENV, "0")
    with pytest.raises(HydraulisError, match="set it to 1"):
        usable_workers()


def test_a_proposal_on_the_cores_is_the_one_planned_in_this_process(monkeypatch):
    """The proposal's sample plans and phase trials fanned out: the same pool, usage and planned times."""
    from hydraulis.cost import load_cost_model
    from hydraulis.planner.proposal.propose import propose
    from hydraulis.specs import ClusterSpec

    cost = load_cost_model("llama-7b@a800-80g+cp")
    rng = np.random.default_rng(3)
    sample = [np.concatenate([np.minimum(rng.lognormal(7.5, 1.2, 30).astype(np.int64) + 32, 20000),
                              [rng.integers(30000, 90000)]]) for _ in range(4)]
    found = {}
    for workers in ("1", "2"):
        monkeypatch.setenv(WORKERS_ENV, workers)
        p = propose(cost, ClusterSpec(8), sample, max_pool=4)
        found[workers] = (p.pool.deployments, p.pool.usage, p.times_s, p.phased_times_s, p.candidates)
    one, two = found["1"], found["2"]
    assert one[0] == two[0] and one[1] == two[1] and one[4] == two[4]
    assert np.array_equal(one[2], two[2]) and np.array_equal(one[3], two[3])
    assert len(one[0]) == 4  # the phase trials ran and added deployments
