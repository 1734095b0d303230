"""fan_out: the proposal's plans on the machine's cores, in forked children, with a loop's results."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hydraulis.errors import HydraulisError
from hydraulis.processes.fan_out import WORKERS_ENV, fan_out, fan_out_grid, forks_allowed, usable_workers


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
    """The proposal's sample plans and phase trials fanned out, on fewer cores than samples and on more (each
    sample's candidates and moves cut in parts): the same pool, usage and planned times."""
    from hydraulis.cost import load_cost_model
    from hydraulis.planner.proposal.propose import propose
    from hydraulis.specs import ClusterSpec

    cost = load_cost_model("llama-7b@a800-80g+cp")
    rng = np.random.default_rng(3)
    sample = [np.concatenate([np.minimum(rng.lognormal(7.5, 1.2, 30).astype(np.int64) + 32, 20000),
                              [rng.integers(30000, 90000)]]) for _ in range(4)]
    found = {}
    for workers in ("1", "2", "7"):
        monkeypatch.setenv(WORKERS_ENV, workers)
        p = propose(cost, ClusterSpec(8), sample, max_pool=4)
        found[workers] = (p.pool.deployments, p.pool.usage, p.times_s, p.phased_times_s, p.candidates)
    one = found["1"]
    for other in (found["2"], found["7"]):
        assert one[0] == other[0] and one[1] == other[1] and one[4] == other[4]
        assert np.array_equal(one[2], other[2]) and np.array_equal(one[3], other[3])
    assert len(one[0]) == 4  # the phase trials ran and added deployments


def _noting_child(row: int, which: range) -> list[tuple[int, int, int]]:
    return [(row, i, os.getpid()) for i in which]


@pytest.mark.parametrize(("rows", "count", "workers"), [(4, 18, 2), (4, 18, 16), (2, 5, 8), (3, 0, 8), (1, 1, 4)])
def test_a_grid_gives_each_rows_results_in_order_and_cuts_rows_only_for_more_cores(rows, count, workers):
    """`fan_out_grid`: row by row, one result per index in order, as a loop gives; each row's indices cut into
    parts only where the rows are fewer than the workers, as many as give each worker one (none beyond `count`)."""
    out = fan_out_grid(_noting_child, range(rows), count, workers=workers)
    assert [[(r, i) for r, i, _ in row] for row in out] == [[(r, i) for i in range(count)] for r in range(rows)]
    children = {pid for row in out for _, _, pid in row}
    items = rows * max(1, min(count, -(-workers // rows)))  # one where a single item runs here, in this process
    assert children == ({os.getpid()} if items == 1 else children - {os.getpid()})
    assert len(children) == (min(workers, items) if count else 0)
