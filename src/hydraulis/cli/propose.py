"""`hydraulis propose`: generate the deployment pool from a workload's length distribution."""

from __future__ import annotations

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
    print_json,
    table,
)
from hydraulis.limits import DEFAULT_MAX_POOL, MAX_POOL

if TYPE_CHECKING:
    from hydraulis.cost import CostModel
    from hydraulis.data.workload import Workload
    from hydraulis.planner.proposal import Proposal
    from hydraulis.specs import ClusterSpec


@app.command()
def propose(
    profile: str = ProfileOption,
    gpus: int = gpus_option(),
    workload: Path = WorkloadOption,
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the hydraulis.pool/1 file."),
    max_pool: int = typer.Option(
        DEFAULT_MAX_POOL, "--max-pool", "-k", help="Most deployments in the pool.", min=1, max=MAX_POOL
    ),
    method: str = typer.Option("hydraulis", "--method", help="hydraulis (data-aware) or published (the DP)."),
    gpus_per_node: int = GpusPerNodeOption,
    tokens_per_batch: int = TokensPerBatchOption,
    num_batches: int = NumBatchesOption,
    seed: int = SeedOption,
    memory_per_rank: str = MemoryPerRankOption,
    dtype: str = DtypeOption,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    interleave: bool = InterleaveOption,
) -> None:
    """Propose a pool: the homogeneous fallback plus heterogeneous deployments the planner will pick."""
    from hydraulis.files import check_output
    from hydraulis.planner.pool import save_pool

    check_output(out, "--out")
    cost, cluster, work = load_job(
        profile, gpus=gpus, gpus_per_node=gpus_per_node, workload=workload, tokens_per_batch=tokens_per_batch,
        num_batches=num_batches, seed=seed, memory_per_rank=memory_per_rank, dtype=dtype,
    )
    cost = cost.with_interleaving() if interleave else cost
    result = _propose_with_progress(cost, cluster, work, max_pool, method)
    save_pool(out, result.pool)
    summary = _summary(result, cost, gpus, method, out)
    if as_json:
        print_json(summary)
        return
    rows = summary["deployments"]
    body = [
        [
            i,
            r["deployment"] + (" (fallback)" if i == 0 else ""),
            r["largest_cap"],
            f"{r['usage']:.0%}",
            f"{r['mean_time_s']:.3f}" if r["mean_time_s"] is not None else "phases only",
        ]
        for i, r in enumerate(rows)
    ]
    title = f"{method} pool for {work.name} on {gpus} GPUs ({cost.name}) -> {out}"
    columns = ["#", "deployment", "largest cap", "batches on it", "mean time s (whole batches)"]
    console.print(table(title, columns, body))
    for line in _table_notes(rows, summary["samples"]):
        console.print(line)
    fallback_tps = summary["fallback_tokens_per_s"]
    console.print(
        f"{summary['samples']} sample batches, {summary['candidates']} candidates planned: "
        f"{result.throughput:,.0f} tokens/s with the pool vs {fallback_tps:,.0f} with the fallback alone "
        f"({result.throughput / fallback_tps:.2f}x), in {result.elapsed_s:.1f} s"
    )


def _table_notes(rows: list[dict], samples: int) -> list[str]:
    """What the table's columns mean where they would mislead: shares over 100% and rows of 0% or no time."""
    notes = []
    total = sum(r["usage"] for r in rows)
    if total > 1.005:
        notes.append(f"batches on it: the share of the {samples} sample batches each runs, whole or as one phase of "
                     f"a phased step; a phased step runs on several, so the shares add up to {total:.0%}")
    idle = [str(i) for i, r in enumerate(rows) if i > 0 and r["usage"] < 0.005]
    if idle:
        notes.append(f"#{', #'.join(idle)}: no sample batch ran on it in the final schedules (it was added while "
                     "the pool was searched); the planner may still choose it for other batches")
    if any(r["mean_time_s"] is None for r in rows):
        notes.append("phases only: it holds no sample batch whole, so it has no whole-batch time; it runs phases")
    return notes


def _propose_with_progress(
    cost: CostModel, cluster: ClusterSpec, work: Workload, max_pool: int, method: str
) -> Proposal:
    """The proposal, with a transient progress bar on stderr (it can take minutes on large clusters)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from hydraulis.planner.proposal import propose as run_proposal

    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}")]
    with Progress(*columns, TimeElapsedColumn(), console=err_console, transient=True) as progress:
        task = progress.add_task("proposing", total=None)

        def report(what: str, done: int, total: int) -> None:
            progress.update(task, description=what, completed=done, total=total)

        return run_proposal(cost, cluster, list(work.batches), max_pool=max_pool, method=method, progress=report)


def _summary(result: Proposal, cost: CostModel, gpus: int, method: str, out: Path) -> dict:
    """What --json prints and the table shows: the pool's deployments and the throughput with and without it."""
    mean_times = [float(t[t < float("inf")].mean()) if (t < float("inf")).any() else None for t in result.times_s]
    rows = [
        {
            "deployment": str(d),
            "replicas": len(d),
            "largest_cap": max(cost.lone_cap(c, gpus) for c in d.configs),
            "usage": u,
            "mean_time_s": m,
        }
        for d, u, m in zip(result.pool.deployments, result.pool.usage or (), mean_times, strict=True)
    ]
    return {
        "profile": cost.name,
        "num_gpus": gpus,
        "method": method,
        "out": str(out),
        "samples": int(result.times_s.shape[1]),
        "candidates": len(result.candidates),
        "tokens_per_s": result.throughput,
        "fallback_tokens_per_s": float(result.sample_tokens.sum() / result.times_s[0].sum()),
        "elapsed_s": result.elapsed_s,
        "deployments": rows,
    }
