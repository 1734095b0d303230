"""A profile's conditions against a run's, and the CPU meter that measures other processes' load."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from hydraulis.cost.conditions import Conditions, CpuMeter, differences, disturbed, spare_core, warning

QUIET = Conditions(world_size=4, threads_per_rank=1, cores=2, foreign_cores=0.02)


def test_a_run_under_its_profiles_conditions_says_nothing():
    assert differences(QUIET, QUIET) == [] and warning(QUIET, QUIET) is None
    assert warning(None, QUIET) is None  # a profile that recorded none: nothing to compare
    assert warning(QUIET, Conditions(4, 1, 2)) is None  # the run's load not measured yet


def test_each_difference_is_named_in_one_line():
    run = Conditions(world_size=2, threads_per_rank=2, cores=2, foreign_cores=0.9)
    line = warning(QUIET, run)
    assert line is not None and "\n" not in line
    assert "2 ranks (the profile: 4)" in line and "2 threads per rank (the profile: 1)" in line
    assert "other processes use 0.90 of 2 cores (while profiling: 0.02)" in line
    # A little load on both sides is no difference; a disturbed profile against a quiet run is.
    assert differences(QUIET, Conditions(4, 1, 2, 0.15)) == []
    assert differences(Conditions(4, 1, 2, 0.8), Conditions(4, 1, 2, 0.0)) != []


def test_the_planner_plans_beside_compute_only_where_the_ranks_leave_a_core():
    assert not spare_core(4, 1, 2) and not spare_core(2, 1, 2) and not spare_core(1, 2, 2)  # the demo, quick start
    assert spare_core(2, 1, 4) and spare_core(1, 1, 2)


def test_conditions_round_trip_and_incomplete_ones_read_as_none():
    assert Conditions.from_json(QUIET.to_json()) == QUIET
    assert Conditions.from_json({"world_size": 4}) is None and Conditions.from_json(None) is None
    assert disturbed(0.3, 2) and not disturbed(0.1, 2) and not disturbed(None, 2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the meter reads /proc")
def test_the_meter_counts_other_processes_and_not_the_jobs_own():
    """A spinning process is foreign to a meter that does not know its pid and the job's own to one that does."""
    spinning = "import sys, time\nprint('spinning', flush=True)\nt = time.time()\nwhile time.time() - t < 60: pass"
    spin = subprocess.Popen([sys.executable, "-c", spinning], stdout=subprocess.PIPE, text=True)
    try:
        assert spin.stdout is not None and spin.stdout.readline() == "spinning\n"  # it spins from now on
        foreign, own = CpuMeter([]), CpuMeter([spin.pid])
        time.sleep(1.0)  # the window both meters read, while the spinner spins
        without, with_it = foreign.foreign_cores(), own.foreign_cores()
    finally:
        spin.kill()
        spin.wait()
    assert without is not None and with_it is not None
    # Both read the same second; the difference is the spinner's CPU time (at least a tenth of a core, however
    # loaded the machine is), and the one that knows the spinner does not count it.
    assert without - with_it > 0.1
