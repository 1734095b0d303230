"""`hydraulis demo`: the whole planning pipeline on a real corpus, end to end.

Real data (CPython's own sources, tokenized with GPT-2 BPE) -> global batches
by token budget -> a proposed deployment pool -> a plan per batch -> the same
batches under the other systems' policies, simulated with the published
LLaMA-7B A800 profile on 32 GPUs. Writes the workload, pool, plan, a
comparison chart and 1F1B timelines to the output directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from hydraulis.cli.app import app
from hydraulis.cli.common import ProfileOption, console, err_console, table
from hydraulis.files import OutputSet, check_output, check_output_dir
from hydraulis.limits import MAX_GPUS, MAX_LENGTH, MAX_TOKENS_PER_BATCH
from hydraulis.progress import rule

if TYPE_CHECKING:
    import numpy as np

    from hydraulis.cost.model import CostModel
    from hydraulis.parallel import Deployment
    from hydraulis.specs import ClusterSpec

DEMO_POLICIES = ("megatron", "flops-balanced", "hotspa", "hydraulis-reference", "hydraulis")


@app.command()
def demo(
    corpus: str = typer.Option("python-stdlib", "--corpus", "-c", help="Built-in corpus or a built corpus directory."),
    profile: str = ProfileOption,
    gpus: int = typer.Option(32, "--gpus", "-n", help="GPUs in the simulated job.", min=1, max=MAX_GPUS),
    tokens_per_batch: int = typer.Option(
        256 * 1024, "--tokens-per-batch", "-T", help="Global batch token budget.", min=1, max=MAX_TOKENS_PER_BATCH
    ),
    max_len: int = typer.Option(
        32 * 1024, "--max-len", "-L", help="Longest sequence; longer documents are split.", min=1, max=MAX_LENGTH
    ),
    batches: int = typer.Option(4, "--batches", "-k", help="Global batches to plan and compare.", min=1, max=64),
    out: Path = typer.Option(Path("demo-out"), "--out", "-o", help="Directory for the demo's files."),
) -> None:
    """Propose a pool, plan real batches and compare with the baselines (simulated)."""
    names = ("workload.json", "pool.json", "plan.json", "compare.png", "timeline.png")
    check_output_dir(out, "--out directory")
    for name in names:
        check_output(out / name)
    with OutputSet() as outputs:  # every file or none, even on Ctrl-C
        _demo(
            corpus, profile, gpus=gpus, tokens_per_batch=tokens_per_batch, max_len=max_len, batches=batches,
            out=out, outputs=outputs,
        )


def _demo(
    corpus: str,
    profile: str,
    gpus: int,
    tokens_per_batch: int,
    max_len: int,
    batches: int,
    out: Path,
    outputs: OutputSet,
) -> None:
    from hydraulis.cost import load_cost_model
    from hydraulis.data.builtin import resolve_corpus
    from hydraulis.data.sampler import TokenBudgetSampler
    from hydraulis.data.stats import length_stats
    from hydraulis.data.workload import Workload, save_workload
    from hydraulis.planner.pool import save_pool
    from hydraulis.planner.proposal.propose import propose
    from hydraulis.specs import ClusterSpec

    cost = load_cost_model(profile)
    cluster = ClusterSpec(gpus)

    rule(console, "1. data")
    c = resolve_corpus(corpus, progress=True)
    st = length_stats(c.lengths)
    console.print(
        f"{c.name}: {st.count:,} documents, {st.tokens:,} tokens; median {st.p50:,}, p99 {st.p99:,}, "
        f"max {st.max:,} tokens; the longest 1% of documents carry {st.top1_sq_share:.0%} of the attention "
        "cost (sum of s^2)"
    )
    sampler = TokenBudgetSampler(c.lengths, tokens_per_batch, max_len=max_len, seed=0)
    work = [b.lengths for b in sampler.batches(batches)]
    # The pool is proposed from other batches of the same data, not fitted to the measured ones.
    sample = [b.lengths for b in TokenBudgetSampler(c.lengths, tokens_per_batch, max_len=max_len, seed=1).batches(4)]
    save_workload(outputs.stage(out / "workload.json"), Workload(f"{c.name}-demo", tuple(work)))
    console.print(
        f"{batches} global batches of {tokens_per_batch:,} tokens (documents over {max_len:,} split): "
        f"{', '.join(str(len(b)) for b in work)} sequences -> {out / 'workload.json'}"
    )

    rule(console, f"2. deployment pool for {cost.name} on {gpus} GPUs")
    with err_console.status("proposing a pool from sample batches"):
        proposal = propose(cost, cluster, sample, max_length=max(int(b.max()) for b in work + sample))
    save_pool(outputs.stage(out / "pool.json"), proposal.pool)
    rows = [
        [i, str(d), max(cost.lone_cap(g, gpus) for g in d.configs), f"{u:.0%}"]
        for i, (d, u) in enumerate(zip(proposal.pool.deployments, proposal.pool.usage or (), strict=True))
    ]
    console.print(table(f"pool -> {out / 'pool.json'}", ["#", "deployment", "largest cap", "tokens on it"], rows))

    _compare(
        cost, cluster, name=c.name, work=work, sample=sample, pool=proposal.pool.deployments, out=out, outputs=outputs
    )


def _compare(
    cost: CostModel,
    cluster: ClusterSpec,
    name: str,
    work: list[np.ndarray],
    sample: list[np.ndarray],
    pool: tuple[Deployment, ...],
    out: Path,
    outputs: OutputSet,
) -> None:
    """Step 3: every demo policy on the batches, the plan file, the comparison and the timelines."""
    from hydraulis.bench import run_policies
    from hydraulis.planner.plan import PlanFile, Schedule, save_plan
    from hydraulis.planner.policy import PolicyContext
    from hydraulis.planner.sim import simulate
    from hydraulis.report import comparison_plot, timeline_plot

    gpus, batches = cluster.num_gpus, len(work)
    rule(console, "3. plan and compare (simulated with the cost model)")
    # The pool is ours, not the user's: the reference keeps its own (the published range DP's).
    ctx = PolicyContext.build(cost, cluster, work, sample=sample, proposed=pool)
    schedules: dict[tuple[str, int], Schedule] = {}
    with err_console.status("planning every batch under every policy"):
        results = run_policies(
            "demo", ctx, work, DEMO_POLICIES, keep=lambda p, step, s: schedules.__setitem__((p, step), s)
        )
    ours_schedules = tuple(schedules[("hydraulis", step)] for step in range(batches))
    save_plan(outputs.stage(out / "plan.json"), PlanFile(cost.name, gpus, ours_schedules))
    rows = [
        [
            r.policy,
            f"{r.tokens_per_s:,.0f}",
            f"{r.speedup_vs_megatron:.2f}x",
            f"{r.balance_efficiency:.2f}",
            f"{r.planning_ms:.0f}",
        ]
        for r in results
    ]
    columns = ["policy", "tokens/s", "vs megatron", "balance eff.", "plan ms/iter"]
    console.print(table(f"{batches} batches of {name} -> {out / 'plan.json'}", columns, rows))
    comparison_plot(results, outputs.stage(out / "compare.png"), f"{name}, {cost.name}, {gpus} GPUs")
    megatron = schedules[("megatron", 0)].phases[0]
    phases = ours_schedules[0].phases
    timeline_plot(
        [
            ("megatron", megatron, simulate(megatron, cost)),
            *((f"hydraulis, phase {k + 1} of {len(phases)}" if len(phases) > 1 else "hydraulis", p, simulate(p, cost))
              for k, p in enumerate(phases)),
        ],
        outputs.stage(out / "timeline.png"),
    )
    ours = next(r for r in results if r.policy == "hydraulis")
    console.print(
        f"hydraulis: {ours.speedup_vs_megatron:.2f}x the throughput of megatron on the same batches. "
        f"Charts: {out / 'compare.png'} (throughput), {out / 'timeline.png'} (1F1B timelines of batch 0)."
    )
