"""The local launcher behind `hydraulis train --nproc`: results in rank order, and a failing rank ends the job."""

from __future__ import annotations

import time

import launch_workers
import pytest

from hydraulis.runtime.parallelism.launch import PG_TIMEOUT, RankFailed, spawn

pytestmark = pytest.mark.dist


def test_results_come_back_in_rank_order():
    assert spawn(launch_workers.ranks, 3) == [(0, 3), (1, 3), (2, 3)]


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("error", "rank 2 exited with code 2: the data of this rank is bad"),
        ("bug", "rank 2 exited with code 1: ZeroDivisionError: a bug"),
        ("kill", "rank 2 died by signal SIGKILL"),
    ],
)
def test_a_failing_rank_ends_the_job_with_its_error(how, expected):
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        spawn(launch_workers.fails_on, 3, 2, how)
    assert str(info.value) == expected
    # The failure ends the job, not the process-group timeout (PG_TIMEOUT) the survivors would wait out.
    assert time.monotonic() - start < PG_TIMEOUT.total_seconds()
    if how == "bug":
        assert "Traceback" in info.value.detail
