"""What planning beside compute costs a training loop in the same process (runtime/plan_feed.py).

A GPU rank's loop launches kernels (a few microseconds of Python each, holding the GIL) and waits on the device
or a peer (the GIL released). Here a loop of small torch ops with a 0.5 ms wait after every 20 stands in for it,
timed alone, beside the planner planning batches in a thread of the same process (as the trainer planned
before runtime/plan_server.py), with a 0.5 ms switch interval too, and beside the same planner in a child
process (`PlanServer`, as the trainer plans now). Each is repeated, interleaved; medians, spreads and the ratio
to the loop alone are printed. Two planners: 64-GPU batches of a 7B model on a four-deployment pool (numpy much
of the time, which lets the GIL go), and long-70b-256g's batches on two interleaved deployments with deferred
weight gradients (4-7 CPU s a batch, mostly the simulator's Python loop).

    PYTHONPATH=src python benchmarks/planner_gil.py [--repeats 5] [--case 7b-64g|70b-256g]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

LOOPS, LAUNCHES, WAIT_S = 300, 20, 0.0005
CASES = ("7b-64g", "70b-256g")


def launch_loop() -> float:
    """Seconds for LOOPS rounds of LAUNCHES small ops and one wait."""
    import torch

    x = torch.zeros(256)
    start = time.perf_counter()
    for _ in range(LOOPS):
        for _ in range(LAUNCHES):
            x = x + 1.0
        time.sleep(WAIT_S)
    return time.perf_counter() - start


def planners(case: str) -> tuple[Callable[[int], object], Callable[[int], object], Callable[[], None]]:
    """(plan batch k in this process, plan batch k in a child, close): two planners alike, one behind a
    `PlanServer`."""
    from hydraulis.bench import get_scenarios
    from hydraulis.cost import load_cost_model
    from hydraulis.parallel import Deployment
    from hydraulis.planner.phases import PhasedPlanner
    from hydraulis.runtime.plan_server import PlanServer
    from hydraulis.specs import ClusterSpec

    if case == "7b-64g":
        gpus, cost, zero_bubble = 64, load_cost_model("llama-7b@a800-80g"), False
        pool = ("32x(tp2,pp1)", "16x(tp4,pp1)", "8x(tp4,pp2)", "16x(tp1,pp4)")
        rng = np.random.default_rng(0)
        batches = [np.concatenate([rng.integers(100, 4000, 400), rng.integers(8000, 32000, 8)]) for _ in range(4)]
    else:
        scenario = get_scenarios(["long-70b-256g-longmix-4m-64k"])[0]
        gpus, cost, zero_bubble = 256, load_cost_model(scenario.profile).with_interleaving().with_policies(True), True
        pool, batches = ("2x(tp1,pp16,cp8,vp5)", "4x(tp1,pp8,cp8,vp5)"), scenario.sample(scenario.seed)
    cluster = ClusterSpec(gpus)
    deployments = [Deployment.parse(t, cluster) for t in pool]
    here = PhasedPlanner(cost, gpus, deployments, zero_bubble=zero_bubble)
    there, server = PhasedPlanner(cost, gpus, deployments, zero_bubble=zero_bubble), PlanServer()
    return (lambda k: here.schedule(batches[k % len(batches)], k),
            lambda k: server.schedule(there, batches[k % len(batches)], k), server.close)


def beside(plan: Callable[[int], object] | None, interval: float | None = None) -> float:
    """The loop's seconds with `plan` planning batches in a thread meanwhile (None: alone)."""
    stop, made = threading.Event(), [0]

    def planning() -> None:
        while not stop.is_set():
            plan(made[0])
            made[0] += 1

    thread = threading.Thread(target=planning, daemon=True) if plan is not None else None
    old = sys.getswitchinterval()
    if interval is not None:
        sys.setswitchinterval(interval)
    if thread is not None:
        thread.start()
        time.sleep(0.2)  # planning under way
    try:
        return launch_loop()
    finally:
        stop.set()
        if thread is not None:
            thread.join()
        sys.setswitchinterval(old)


def main(repeats: int, cases: tuple[str, ...]) -> None:
    for case in cases:
        here, there, close = planners(case)
        here(0), there(0)  # each planner warm, the child forked, as after a run's first plan
        modes = {"alone": (None, None), "planner thread": (here, None), "planner thread, 0.5 ms switch": (here, 5e-4),
                 "planner process (PlanServer)": (there, None)}
        times: dict[str, list[float]] = {m: [] for m in modes}
        try:
            for _ in range(repeats):
                for mode, (plan, interval) in modes.items():
                    times[mode].append(beside(plan, interval))
        finally:
            close()
        base = float(np.median(times["alone"]))
        print(f"{case}: a loop of {LOOPS} x ({LAUNCHES} small torch ops, a {WAIT_S * 1e3:.1f} ms wait); {repeats} "
              f"interleaved repeats, median [min-max]:")
        for mode, ts in times.items():
            med = float(np.median(ts))
            print(f"  {mode:32s} {med:7.3f} s [{min(ts):.3f}-{max(ts):.3f}]  {med / base:5.2f}x the loop alone")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--case", choices=CASES, action="append", help="default: both")
    args = parser.parse_args()
    main(args.repeats, tuple(args.case or CASES))
