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
    gpus_option,
    load_job,
    print_json,
    table,
)
from hydraulis.limits import DEFAULT_MAX_POOL, MAX_POOL

if TYPE_CHECKING:
    from hydraulis.cost import CostModel
    from hydraulis.data.workload import Workload
    from hydraulis.planner.proposal.propose import Proposal
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
    body = [[i, r["deployment"] + (" (fallback)" if i == 0 else ""), r["largest_cap"], f"{r['usage']:.0%}",
             f"{r['batches']} of {summary['samples']}", "-" if r["mean_time_s"] is None else f"{r['mean_time_s']:.3f}"]
            for i, r in enumerate(rows)]
    title = f"{method} pool for {work.name} on {gpus} GPUs ({cost.name}) -> {out}"
    columns = ["#", "deployment", "largest cap", "tokens on it", "batches on it", "mean iteration s"]
    console.print(table(title, columns, body))
    for line in _table_notes(summary):
        console.print(line)
    fallback_tps = summary["fallback_tokens_per_s"]
    console.print(
        f"{summary['samples']} sample batches, {summary['candidates']} candidates planned: "
        f"{result.throughput:,.0f} tokens/s with the pool vs {fallback_tps:,.0f} with the fallback alone "
        f"({result.throughput / fallback_tps:.2f}x), in {result.elapsed_s:.1f} s"
    )


def _table_notes(summary: dict) -> list[str]:
    """What the columns count, and why a deployment that runs none of the samples' tokens stays in the pool."""
    rows, samples = summary["deployments"], summary["samples"]
    notes = [f"tokens on it: its share of the {samples} sample batches' tokens as the planner chose (whole batches "
             "or phases); batches on it: those it runs, whole or a phase; mean iteration s: theirs, simulated"]
    if summary["phased"]:
        notes.append(f"{summary['phased']} of the {samples} batches ran in phases, one after another: each "
                     "deployment's share counts its phases' tokens")
    if rows[0]["batches"] == 0:
        notes.append("#0 runs none of them but stays: the fallback holds every batch up to the longest sequence; "
                     "its time is its whole batches'")
    if idle := [i for i, r in enumerate(rows) if i > 0 and r["batches"] == 0]:
        why = ("the published generator's pool, as it makes it" if summary["method"] == "published" else
               "the samples planned without them were slower (the phased planner cuts batches at the pool's caps)")
        blank = " (-: it holds none whole)" if any(rows[i]["mean_time_s"] is None for i in idle) else ""
        notes.append(f"#{', #'.join(map(str, idle))} run none of them but stay: {why}; their time is their whole "
                     f"batches'{blank}")
    return notes


def _propose_with_progress(
    cost: CostModel, cluster: ClusterSpec, work: Workload, max_pool: int, method: str
) -> Proposal:
    """The proposal, with progress on stderr (it can take minutes on large clusters)."""
    from hydraulis.errors import SHORTER_WORKLOAD, HydraulisError, OverlongError
    from hydraulis.planner.proposal.propose import propose as run_proposal
    from hydraulis.progress import stage_progress

    with stage_progress("proposing") as report:
        try:
            return run_proposal(cost, cluster, list(work.batches), max_pool=max_pool, method=method, progress=report)
        except OverlongError as exc:  # propose has no --overlong: the workload's maker cuts them
            raise HydraulisError(exc.worded(SHORTER_WORKLOAD, "--profile {}")) from None


def _summary(result: Proposal, cost: CostModel, gpus: int, method: str, out: Path) -> dict:
    """What --json prints and the table shows: the pool's deployments and the throughput with and without it."""
    import numpy as np

    on = result.tokens_on > 0  # [deployments, samples]: the batches each runs, whole or a phase
    iterations = result.best_times_s if result.phased_times_s is None else result.phased_times_s
    rows = []
    for d, u, runs, whole in zip(result.pool.deployments, result.pool.usage or (), on, result.times_s, strict=True):
        # the mean iteration of the batches it runs; of one that runs none (the fallback), its whole batches'
        held = whole[np.isfinite(whole)]
        mean = iterations[runs].mean() if runs.any() else held.mean() if len(held) else None
        rows.append({"deployment": str(d), "replicas": len(d), "usage": u, "batches": int(runs.sum()),
                     "largest_cap": max(cost.lone_cap(c, gpus) for c in d.configs),
                     "mean_time_s": None if mean is None else float(mean)})
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
        "phased": int((on.sum(axis=0) > 1).sum()),  # sample batches run in phases of several deployments
        "deployments": rows,
    }
