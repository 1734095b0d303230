"""`hydraulis plan`: plan every global batch of a workload and write a `hydraulis.plan/1` file."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from hydraulis.cli.app import app
from hydraulis.cli.common import (
    DtypeOption,
    GpusPerNodeOption,
    InterleaveOption,
    MemoryPerRankOption,
    NumBatchesOption,
    ProfileOption,
    SeedOption,
    TokensPerBatchOption,
    WorkloadOption,
    console,
    err_console,
    gpus_option,
    load_job,
    table,
    totals_line,
)
from hydraulis.errors import HydraulisError
from hydraulis.progress import steps_progress

if TYPE_CHECKING:
    import numpy as np

    from hydraulis.cost.model import CostModel
    from hydraulis.planner.plan import Schedule
    from hydraulis.planner.policy import Policy


MemoryPoliciesOption = typer.Option(
    False, "--memory-policies", help="hydraulis: choose a memory policy per micro-batch (none, selective or full "
    "recompute), the lightest whose cap holds it ([parallel] memory_policies).",
)


@app.command()
def plan(
    profile: str = ProfileOption,
    gpus: int = gpus_option(),
    workload: Path = WorkloadOption,
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the hydraulis.plan/1 file."),
    pool: str = typer.Option(
        None, "--pool", help="Deployments separated by ';' (e.g. '16x(tp2,pp1); 1x(tp8,pp1) + 12x(tp2,pp1)')."
    ),
    policy: str = typer.Option("hydraulis", "--policy", help="hydraulis or a baseline (see `hydraulis bench`)."),
    overlong: str = typer.Option(
        "auto",
        "--overlong",
        help="Sequences longer than every cap of the pool (CP replicas included): auto (keep whole what "
        "the pool holds, refuse the rest), split, truncate or drop.",
    ),
    gpus_per_node: int = GpusPerNodeOption,
    tokens_per_batch: int = TokensPerBatchOption,
    num_batches: int = NumBatchesOption,
    seed: int = SeedOption,
    memory_per_rank: str = MemoryPerRankOption,
    dtype: str = DtypeOption,
    memory_policies: bool = MemoryPoliciesOption,
    interleave: bool = InterleaveOption,
    zero_bubble: bool = typer.Option(
        False, "--zero-bubble", help="hydraulis: defer each pipelined replica's weight gradients into its stages' "
        "gaps where that simulates faster (the plan file's `deferral`)."
    ),
) -> None:
    """Choose a deployment, dispatch and pack each global batch of a workload."""
    from hydraulis.baselines import make_policy
    from hydraulis.files import check_output
    from hydraulis.planner.plan import PlanFile, save_plan
    from hydraulis.planner.policy import PolicyContext
    from hydraulis.planner.pool import largest_cap, parse_pool
    from hydraulis.planner.schedule import schedule_text

    check_output(out, "--out")
    _check_policy(policy, memory_policies)
    cost, cluster, work = load_job(
        profile, gpus=gpus, gpus_per_node=gpus_per_node, workload=workload, tokens_per_batch=tokens_per_batch,
        num_batches=num_batches, seed=seed, memory_per_rank=memory_per_rank, dtype=dtype,
    )
    cost = (cost.with_interleaving() if interleave else cost).with_policies(memory_policies)
    deployments = parse_pool(pool, cluster) if pool else None
    batches = _within_caps(work.batches, largest_cap(cost, cluster, deployments), overlong, workload, cost)
    ctx = dataclasses.replace(PolicyContext.build(cost, cluster, batches, deployments), interleave=interleave,
                              zero_bubble=zero_bubble)
    proposes = deployments is None and policy == "hydraulis"
    with err_console.status("proposing a deployment pool from the workload" if proposes else "preparing"):
        chosen = make_policy(policy, ctx)
    plans = _schedule_all(chosen, batches)
    save_plan(out, PlanFile(cost.name, gpus, tuple(plans), gpus_per_node))
    rows = [
        [
            p.step,
            schedule_text(p, chosen.cost, gpus),  # phases one after another, repeated ones merged and explained
            p.num_tokens,
            len(p.lengths),
            f"{p.iteration_time_s:.3f}",
            f"{p.num_tokens / p.iteration_time_s:,.0f}",
            f"{p.planning_time_s * 1e3:.1f}",
        ]
        for p in plans
    ]
    columns = ["step", "deployment(s)", "tokens", "seqs", "time s", "tokens/s", "plan ms"]
    console.print(table(f"{policy} plan for {work.name} on {gpus} GPUs ({cost.name}) -> {out}", columns, rows))
    console.print(totals_line(len(plans), sum(p.num_tokens for p in plans), sum(p.iteration_time_s for p in plans),
                              "predicted") + f"; planning {sum(p.planning_time_s for p in plans) * 1e3:.1f} ms")
    if proposes:
        console.print(f"proposed pool (`hydraulis propose` saves one): {'; '.join(str(d) for d in ctx.pool)}")


def _schedule_all(chosen: Policy, batches: list[np.ndarray]) -> list[Schedule]:
    """Each global batch's schedule under the chosen policy, in order, with a progress bar."""
    plans = []
    with steps_progress(f"planning {len(batches)} iteration(s)", len(batches)) as advance:
        for step, b in enumerate(batches):
            plans.append(chosen.schedule(b, step))
            advance(f"batch {step}", 1)
    return plans


def _check_policy(policy: str, memory_policies: bool) -> None:
    """A policy `hydraulis plan` can write a plan file for, with memory policies only for hydraulis."""
    from hydraulis.baselines import OWN_CONFIGS

    if policy in OWN_CONFIGS:
        raise HydraulisError(
            f"policy {policy} regroups the ranks for every micro-batch, on CP group sizes of its own that the "
            f"profile does not hold, and a plan file's deployments are the profile's; compare it with "
            f"`hydraulis bench --policy {policy}` instead"
        )
    if memory_policies and policy != "hydraulis":
        raise HydraulisError(f"--memory-policies is the hydraulis policy's; {policy} plans without them")


def _within_caps(
    batches: Sequence[np.ndarray], largest: tuple[int, str], overlong: str, workload: Path, cost: CostModel
) -> list[np.ndarray]:
    """The workload's batches after the --overlong policy against the pool's largest cap (one line if any changed)."""
    from hydraulis.planner.planner import apply_overlong

    cap, cap_name = largest
    out, changed = [], 0
    has_cp = any(g.cp > 1 for g in cost.configs)
    remedies = ("a pool with larger (CP) replicas", "more GPUs") if has_cp else ("more GPUs",)
    for i, b in enumerate(batches):
        fixed = apply_overlong(b, cap, cap_name, overlong, where=f"{workload}: batch {i}", remedies=remedies,
                               cp_profile=None if has_cp else cost.name)
        out.append(fixed.lengths)
        changed += fixed.changed
    if changed:
        verb = {"split": "split", "truncate": "truncated"}.get(overlong, "dropped")
        err_console.print(f"{verb} {changed} sequence(s) longer than the largest cap {cap} ({cap_name})")
    return out


@app.command()
def bench(
    scenario: list[str] = typer.Option(None, "--scenario", "-s", help="Scenario name (repeatable); default: all."),
    policy: list[str] = typer.Option(None, "--policy", help="Policy (repeatable); default: all."),
    group: str = typer.Option(
        None, "--group", help="Scenario group: main (8K-32K) or long (64K-512K); default: all (or the --scenario)."
    ),
    out: Path = typer.Option(Path("bench-out"), "--out", "-o", help="Directory for bench.json and bench.png."),
    list_only: bool = typer.Option(False, "--list", help="List scenarios and policies, run nothing."),
    vp1: bool = typer.Option(False, "--vp1", help="Every policy runs plain 1F1B (vp = 1), as before interleaving."),
    fused_backward: bool = typer.Option(
        False, "--fused-backward", help="hydraulis runs each backward whole, as before it deferred weight gradients."
    ),
) -> None:
    """Run every policy on built-in scenarios; print a table, write JSON and a PNG bar chart."""

    from hydraulis.baselines import POLICIES
    from hydraulis.bench import get_scenarios, run_bench
    from hydraulis.files import OutputSet, check_output, check_output_dir, write_json_atomic
    from hydraulis.plots import check_plot_path
    from hydraulis.report import bench_plot, bench_table, summary_lines

    chosen = get_scenarios(scenario, group)
    if not list_only:
        check_output_dir(out, "--out directory")
        check_output(out / "bench.json")
        check_plot_path(out / "bench.png")
    policies = list(policy) if policy else list(POLICIES)
    if list_only:
        rows = [[s.name, s.group, s.profile, s.num_gpus, s.tokens_per_batch, s.max_length, s.lengths] for s in chosen]
        columns = ["name", "group", "profile", "GPUs", "tokens/batch", "max len", "lengths"]
        console.print(table("scenarios", columns, rows))
        console.print("policies: " + ", ".join(POLICIES))
        return
    with steps_progress(f"{len(chosen)} scenario(s)", len(chosen)) as advance:
        report = run_bench(chosen, policies, lambda s: advance(s.name, 1), interleave=not vp1,
                           zero_bubble=not fused_backward)
    with OutputSet() as outputs:  # both files or neither
        write_json_atomic(outputs.stage(out / "bench.json"), report)
        bench_plot(report, outputs.stage(out / "bench.png"))
    console.print(bench_table(report))
    every = get_scenarios(None, None)
    judged = {s.name for s in chosen} == {s.name for s in every} and set(policies) == set(POLICIES)
    for line in summary_lines(report, judged):
        console.print(line)
    if not judged:  # the project's targets are for its whole set: a subset is not judged against them
        console.print(f"the project's targets (docs/results.md) are for all {len(every)} scenarios and "
                      f"{len(POLICIES)} policies; this run has {len(chosen)} and {len(set(policies))}, so it is not "
                      "judged against them")
    console.print(f"wrote {out / 'bench.json'} and {out / 'bench.png'} ({report['wall_s']:.0f} s)")
