"""`hydraulis caps` and `hydraulis simulate`: the cost model and the simulator."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from hydraulis.cli.app import app
from hydraulis.cli.common import (
    DtypeOption,
    MemoryPerRankOption,
    ProfileOption,
    console,
    print_json,
    table,
    totals_line,
)
from hydraulis.errors import HydraulisError
from hydraulis.limits import MAX_GPUS

if TYPE_CHECKING:
    from hydraulis.planner.plan import Schedule
    from hydraulis.planner.sim import SimResult

CAPS_LENGTHS = (1024, 4096, 16384, 32768)


@app.command()
def caps(
    profile: str = ProfileOption,
    gpus: int = typer.Option(
        32, "--gpus", "-n", help="GPUs in the job (optimizer states shard over all).", min=1, max=MAX_GPUS
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    memory_per_rank: str = MemoryPerRankOption,
    dtype: str = DtypeOption,
) -> None:
    """Token cap and cost of each parallel config."""
    from hydraulis.cli.common import cost_model

    if gpus < 1:
        raise HydraulisError(f"--gpus must be positive, got {gpus}")
    cost = cost_model(profile, memory_per_rank, dtype)
    rows = []
    for config, cap in cost.caps(gpus).items():
        c = cost.coefficients(config)
        lone = cost.lone_cap(config, gpus)
        times = {s: (cost.stage_time(config, [s]) * 1e3 if s <= lone else None) for s in CAPS_LENGTHS}
        rows.append(
            {
                "config": config.name,
                "gpus": config.num_gpus,
                "cap_tokens": cap,
                # a replica's only micro-batch: a deep replica holds it once, not pp times
                "lone_cap_tokens": lone,
                "state_bytes": cost.memory.state_bytes(config, cost.model, gpus),
                "min_efficient_tokens": cost.min_efficient_tokens(config),
                # The optimizer exchange's transient per GPU: two buffers of at most one bucket each.
                "exchange_bytes": cost.memory.exchange_buffer_bytes(cost.model),
                "a_s": c.a,
                "b_s": c.b,
                "c_s": c.c,
                "stage_ms": {str(s): t for s, t in times.items()},
            }
        )
    if as_json:
        memory = {"memory_per_rank_bytes": cost.memory.memory_bytes, "usable_bytes": cost.memory.usable_bytes}
        print_json({"profile": cost.name, "num_gpus": gpus, "dtype": dtype, **memory, "configs": rows})
        return
    columns = ["config", "GPUs", "cap (tokens)", "lone cap", "min eff.", "state MiB", "exch. MiB"]
    columns += [f"t({s // 1024}K) ms" for s in CAPS_LENGTHS]
    body = [
        [r["config"], r["gpus"], r["cap_tokens"], r["lone_cap_tokens"], r["min_efficient_tokens"],
         f"{r['state_bytes'] / 2**20:.1f}", f"{r['exchange_bytes'] / 2**20:.0f}"]
        + [f"{t:.1f}" if t is not None else "-" for t in r["stage_ms"].values()]
        for r in rows
    ]
    title = f"{cost.name} on {gpus} GPUs, {dtype}, {cost.memory.memory_bytes / 2**20:,.0f} MiB per rank"
    console.print(table(f"{title} (time: one sequence, one stage, fwd+bwd)", columns, body))


@app.command()
def simulate(
    plan: Path = typer.Option(..., "--plan", help="A hydraulis.plan/1 file."),
    profile: str = typer.Option(None, "--profile", "-p", help="Cost model; default: the plan's own profile."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    timeline: Path = typer.Option(
        None, "--timeline", help="Write a plot (.png/.svg/.pdf) of the 1F1B timelines (first 4 steps)."
    ),
) -> None:
    """Simulate each iteration of a plan with 1F1B and report its times."""
    from hydraulis.cost import load_cost_model
    from hydraulis.planner.plan import load_plan
    from hydraulis.planner.schedule import check_schedule, phases_time, schedule_text
    from hydraulis.planner.sim import simulate as run_sim

    if timeline is not None:
        from hydraulis.plots import check_plot_path

        check_plot_path(timeline, "--timeline")
    plan_file = load_plan(plan)
    cost = load_cost_model(profile or plan_file.profile)
    results, drawn = [], []
    for i, it in enumerate(plan_file.iterations):
        check_schedule(it, cost, where=f"{plan}: iterations[{i}]")
        sims = [run_sim(p, cost, keep_events=timeline is not None and i < 4) for p in it.phases]
        if timeline is not None and i < 4:
            for k, (p, res) in enumerate(zip(it.phases, sims, strict=True)):
                drawn.append((f"step {it.step}" + (f", phase {k + 1}" if len(it.phases) > 1 else ""), p, res))
        results.append(_simulated(it, sims, phases_time(it.phases, cost, it.switch_s)))
    if timeline is not None:
        from hydraulis.report import timeline_plot

        timeline_plot(drawn, timeline)
    if as_json:
        print_json({"profile": cost.name, "num_gpus": plan_file.num_gpus, "iterations": results})
        return
    columns = ["step", "deployment", "tokens", "mbs", "time s", "sync s", "bubble", "most idle GPU s", "tokens/s"]
    body = [
        [
            r["step"],
            schedule_text(it, cost, plan_file.num_gpus),  # repeated phases merged and explained (JSON: each phase)
            r["tokens"],
            r["micro_batches"],
            f"{r['iteration_time_s']:.3f}",
            f"{r['grad_sync_s']:.3f}",
            f"{r['bubble_fraction']:.1%}",
            _most_idle(r["gpu_idle_s"]),
            f"{r['tokens_per_s']:,.0f}",
        ]
        for it, r in zip(plan_file.iterations, results, strict=True)
    ]
    console.print(table(f"simulated {plan} with {cost.name}", columns, body))
    tokens, seconds = sum(r["tokens"] for r in results), sum(r["iteration_time_s"] for r in results)
    console.print(totals_line(len(results), tokens, seconds, "simulated"))
    if timeline is not None:
        console.print(f"wrote {timeline} (the 1F1B timelines of the first {min(4, len(results))} step(s))")


def _simulated(it: Schedule, sims: list[SimResult], total: float) -> dict:
    """One iteration's simulated figures; `gpu_idle_s`: each GPU's time without work during compute."""
    import numpy as np

    compute = sum(r.compute_time_s for r in sims)
    idle = np.sum([r.gpu_idle_s for r in sims], axis=0)
    return {
        "step": it.step,
        "deployment": " | ".join(str(p.deployment) for p in it.phases),
        "phases": len(it.phases),
        "tokens": it.num_tokens,
        "sequences": len(it.lengths),
        "micro_batches": sum(len(r.micro_batches) for p in it.phases for r in p.replicas),
        # per phase, the replicas whose weight gradients the plan defers (`ReplicaPlan.deferral`)
        "deferred_replicas": [[r for r, replica in enumerate(p.replicas) if replica.deferral] for p in it.phases],
        "iteration_time_s": total,
        "compute_time_s": compute,
        "grad_sync_s": total - compute,  # the optimizer step, and every phase switch
        "bubble_fraction": float(idle.sum() / (compute * len(idle))) if compute > 0 else 0.0,
        "gpu_idle_s": [float(x) for x in idle],
        "predicted_time_s": it.iteration_time_s,
        "tokens_per_s": it.num_tokens / total,
    }


def _most_idle(idle: list[float]) -> str:
    gpu = max(range(len(idle)), key=idle.__getitem__)
    return f"{idle[gpu]:.3f} (GPU {gpu})"
