"""Tables and plots of results: benchmarks, plans, and a training run's report.png (matplotlib only to plot)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hydraulis.plots import pyplot, save_figure

if TYPE_CHECKING:
    from hydraulis.bench import PolicyResult
    from hydraulis.planner.plan import IterationPlan
    from hydraulis.planner.sim import SimResult


def bench_table(report: dict) -> Any:
    from hydraulis.progress import table

    rows, last = [], None
    for r in report["results"]:
        rows.append([
            r["scenario"] if r["scenario"] != last else "",
            r["policy"],
            f"{r['tokens_per_s']:,.0f}",
            f"{r['speedup_vs_megatron']:.2f}x",
            f"{r['balance_efficiency']:.3f}",
            f"{r['planning_ms']:.1f}",
        ])  # fmt: skip
        last = r["scenario"]
    columns = ["scenario", "policy", "tokens/s", "vs megatron", "balance eff.", "plan ms/iter"]
    return table("hydraulis bench (simulated; same cost model and batches for every policy)", columns, rows, left=2)


# summary key: (label, format, target: the least value that meets it, or None)
SUMMARY_TARGETS: dict[str, tuple[str, str, float | None]] = {
    "speedup_vs_best_other_min": ("hydraulis vs the best other policy, worst scenario", "{:.3f}x", 1.0),
    "speedup_vs_best_other_geomean": ("hydraulis vs the best other policy, geometric mean", "{:.3f}x", 1.08),
    "speedup_vs_best_other_geomean_main": ("... on the main scenarios (8K-32K)", "{:.3f}x", 1.02),
    "speedup_vs_best_other_geomean_long": ("... on the long-context scenarios (64K-512K)", "{:.3f}x", 1.05),
    "min_balance_efficiency": ("hydraulis balance efficiency, worst scenario", "{:.3f}", 0.92),
    "speedup_vs_reference_geomean": ("hydraulis vs hydraulis-reference, geometric mean", "{:.3f}x", 1.1),
    "speedup_vs_reference_min": ("hydraulis vs hydraulis-reference, worst scenario", "{:.3f}x", 0.99),
    "speedup_vs_megatron_min_long": ("hydraulis vs megatron, worst scenario with max length >= 16K", "{:.2f}x", 1.2),
    "max_planning_ms": ("hydraulis planning per iteration, worst scenario", "{:.1f} ms", None),
}


def summary_lines(report: dict, judged: bool = True) -> list[str]:
    """The summary, each figure with its target and whether this run met it; not `judged` (a run of fewer
    scenarios or policies than the project's targets are for), the figures alone."""
    s = report["summary"]
    lines = [
        f"hydraulis vs the best other policy on {name}: {b['speedup']:.3f}x ({b['policy']})"
        for name, b in s.get("best_other", {}).items()
    ]
    for key, (label, fmt, target) in SUMMARY_TARGETS.items():
        if key not in s:
            continue
        line = f"{label}: {fmt.format(s[key])}"
        if target is not None and judged:
            line += f" (target >= {fmt.format(target)}: {'met' if s[key] >= target else 'NOT met'})"
        lines.append(line)
    return lines


def bench_plot(report: dict, path: str | Path) -> None:
    """Grouped bars: throughput relative to megatron, per scenario and policy, each bar labelled with its value
    (1.27 and 1.19 look alike as bars); the legend beside the axes, where it hides no bar."""
    import numpy as np

    plt = pyplot()

    scenarios = [s["name"] for s in report["scenarios"]]
    policies = report["policies"]
    value = {(r["scenario"], r["policy"]): r["speedup_vs_megatron"] for r in report["results"]}
    x = np.arange(len(scenarios))
    width = 0.8 / max(1, len(policies))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(scenarios)) + 2.5, 4.8))
    for k, p in enumerate(policies):
        heights = [value.get((s, p), 0) for s in scenarios]
        bars = ax.bar(x + (k - (len(policies) - 1) / 2) * width, heights, width, label=p)
        ax.bar_label(bars, [f"{h:.2f}" if h else "" for h in heights], rotation=90, padding=2,
                     fontsize=7 if len(scenarios) * len(policies) <= 24 else 6)
    many = len(scenarios) > 1
    ax.set_xticks(x, scenarios, rotation=30 if many else 0, ha="right" if many else "center", fontsize=8)
    ax.set_ylabel("throughput vs megatron (x)")
    ax.set_ylim(0, max([*value.values(), 1.0]) * 1.18)  # room for the labels above the bars
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.legend(fontsize=8, title="policy", title_fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              frameon=False)
    ax.set_title("hydraulis bench: simulated throughput relative to megatron\n(the same cost model and batches "
                 "for every policy)", fontsize=10, loc="left")
    fig.tight_layout()
    save_figure(fig, path)


def comparison_plot(results: Sequence[PolicyResult], path: str | Path, title: str) -> None:
    """Horizontal bars of throughput per policy on the same batches, labelled with the speedup."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(results)))
    names = [r.policy for r in results]
    values = [r.tokens_per_s for r in results]
    bars = ax.barh(names, values, color=["#d62728" if n == "hydraulis" else "#7f7f7f" for n in names])
    for bar, r in zip(bars, results, strict=True):
        ax.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {r.speedup_vs_megatron:.2f}x",
            va="center",
            fontsize=8,
        )
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (simulated)")
    ax.set_xlim(0, max(values) * 1.15)
    ax.set_title(title, fontsize=9, loc="left")
    fig.tight_layout()
    save_figure(fig, path)


def timeline_plot(runs: Sequence[tuple[str, IterationPlan, SimResult]], path: str | Path) -> None:
    """1F1B timelines of iterations, one panel each on a shared time axis: where the GPUs wait.

    Rows are pipeline stages of each replica (labelled by config, in the replica's colour); each replica's
    blocks are in its own colour, forward light and backward dark (where the plan defers its weight gradients,
    `ReplicaPlan.deferral`, the backward is B and each W a hatched block of its own), micro-batches parted by a
    thin white edge; the gradient synchronisation closes each panel. The legend's swatches are those colours.
    """
    plt = pyplot()
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.patches import Patch

    horizon = max(res.iteration_time_s for _, _, res in runs)
    heights = [sum(r.config.pp for r in plan.deployment.replicas) for _, plan, _ in runs]
    fig, axes = plt.subplots(
        len(runs),
        1,
        figsize=(11, 1.2 + 0.16 * sum(heights) + 0.5 * len(runs)),
        gridspec_kw={"height_ratios": [max(h, 2) for h in heights]},
        squeeze=False,
    )
    colours = plt.get_cmap("tab10").colors
    forward_alpha, weight_alpha = 0.45, 0.75
    shades = (forward_alpha, 1.0, weight_alpha)  # forward, backward (B where W is deferred), deferred W
    for ax, (label, plan, res), rows in zip(axes[:, 0], runs, heights, strict=True):
        y, ticks, names = 0, [], []
        for r, (replica, timeline) in enumerate(zip(plan.deployment.replicas, res.timelines, strict=True)):
            for stage, _mb, kind, start, end in timeline.events if timeline.events is not None else ():
                ax.barh(y + stage, end - start, left=start, height=0.85, color=colours[r % len(colours)],
                        alpha=shades[int(kind)], edgecolor="white", linewidth=0.6, hatch="////" if kind == 2 else None)
            ticks.append(y + (replica.config.pp - 1) / 2)
            names.append(f"{r}: {replica.config.name}")
            y += replica.config.pp
        ax.axvspan(res.compute_time_s, res.iteration_time_s, color="grey", alpha=0.3)
        ax.set_ylim(rows - 0.5, -0.5)
        ax.set_xlim(0, horizon * 1.01)
        step = max(1, len(ticks) // 24)
        ax.set_yticks(ticks[::step], names[::step], fontsize=7)
        for tick, r in zip(ax.get_yticklabels(), range(0, len(ticks), step), strict=True):
            tick.set_color(colours[r % len(colours)])
        ax.set_title(
            f"{label}: {plan.deployment} - {res.iteration_time_s:.2f} s, bubble {res.bubble_fraction:.0%}",
            fontsize=9,
            loc="left",
        )
    axes[-1, 0].set_xlabel("seconds")
    shown = colours[: min(len(colours), max(len(plan.deployment.replicas) for _, plan, _ in runs))]
    deferred = any(r.deferral for _, plan, _ in runs for r in plan.replicas)  # W blocks drawn: their swatch too
    handles = [tuple(Patch(color=c, alpha=forward_alpha) for c in shown), tuple(Patch(color=c) for c in shown),
               *([tuple(Patch(facecolor=c, edgecolor="white", alpha=weight_alpha, hatch="////") for c in shown)]
                 if deferred else []), Patch(color="grey", alpha=0.3)]
    labels = ["forward (each replica's colour, light)", "backward (dark)",
              *(["deferred weight gradients (hatched)"] if deferred else []), "gradient sync"]
    axes[0, 0].legend(
        handles=handles,
        labels=labels,
        handler_map={tuple: HandlerTuple(ndivide=None, pad=0)},
        handlelength=max(2.0, 0.8 * len(shown)),
        fontsize=7,
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncols=2 if deferred else 3,
        frameon=False,
    )
    fig.tight_layout()
    save_figure(fig, path)


def iteration_errors(rows: list[dict[str, Any]]) -> list[float]:
    """|predicted - measured| / measured iteration time of each step: the cost model's fidelity in training."""
    return [abs(r["predicted_s"] - r["iteration_s"]) / r["iteration_s"] for r in rows if r["iteration_s"] > 0]


def training_plot(rows: list[dict[str, Any]], path: str | Path, title: str, budget_bytes: int | None = None) -> None:
    """Loss, tokens/s, deployment per step, predicted against measured replica times, memory (and the budget,
    `memory_per_rank`) and the learning rate; step axes in whole steps; `title` names the run."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    steps = np.array([r["step"] for r in rows])
    fig, axes = plt.subplots(2, 3, figsize=(17, 7.5))
    memory_panel(axes[0, 2], rows, budget_bytes)
    ax = axes[1, 2]
    ax.plot(steps, [r["lr"] for r in rows], color="tab:brown")
    ax.set(title="learning rate", xlabel="step", ylabel="lr")
    ax.set_ylim(bottom=0)
    for ax in (axes[0, 0], axes[0, 1], axes[0, 2], axes[1, 0], axes[1, 2]):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax = axes[0, 0]
    ax.plot(steps, [r["loss"] for r in rows], color="tab:blue", label="training batch")
    evaluated = [r for r in rows if "eval_loss" in r]  # [eval]: after the step of its row
    if evaluated:
        ax.plot([r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated], "o-", color="tab:orange",
                label="held-out (eval)")  # fmt: skip
        ax.legend(fontsize=8)
    ax.set(title="loss (mean over the target tokens)", xlabel="step", ylabel="loss")
    ax = axes[0, 1]
    ax.plot(steps, [r["tokens_per_s"] for r in rows], color="tab:green")
    ax.set(title="throughput", xlabel="step", ylabel="tokens/s")
    ax = axes[1, 0]
    names = list(dict.fromkeys(r["deployment"] for r in rows))
    ax.scatter(steps, [names.index(r["deployment"]) for r in rows], s=12, c="tab:purple")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set(title="deployment of each step", xlabel="step")
    ax = axes[1, 1]
    predicted = np.array([t for r in rows for t in r["replica_predicted_s"]])
    measured = np.array([t for r in rows for t in r["replica_s"]])
    busy = measured > 0
    ax.scatter(predicted[busy], measured[busy], s=10, alpha=0.6, label="replica (busy)")
    ax.scatter(
        [r["predicted_s"] for r in rows],
        [r["iteration_s"] for r in rows],
        s=10,
        alpha=0.6,
        label="iteration",
        color="tab:red",
    )
    top = float(max(predicted.max(initial=0), measured.max(initial=0), max(r["iteration_s"] for r in rows))) * 1.05
    ax.plot([0, top], [0, top], color="gray", lw=1, ls="--", label="measured = predicted")
    ax.fill_between([0, top], [0, top / 1.15], [0, top / 0.85], color="gray", alpha=0.12, lw=0, label="within 15%")
    errors = iteration_errors(rows)
    median = f"{statistics.median(errors):.0%}" if errors else "n/a"
    worst = f"{max(errors):.0%}" if errors else "n/a"
    ax.set(
        title=f"cost model: predicted vs measured\niteration time error: median {median}, worst {worst}",
        xlabel="predicted s",
        ylabel="measured s",
        xlim=(0, top),
        ylim=(0, top),
    )
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    save_figure(fig, path)


def memory_panel(ax: Any, rows: list[dict[str, Any]], budget_bytes: int | None = None) -> None:
    """Per step, the largest rank's peak memory: predicted (every step) and measured (where measured), and
    the budget (`memory_per_rank`) as a line when there is one."""
    mib = 2.0**20
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r.get("memory_predicted_bytes", 0) / mib for r in rows], color="tab:orange", label="predicted")
    measured = [r for r in rows if r.get("memory_peak_bytes")]  # null (or 0, before 2026-12-05): not measured
    ax.scatter([r["step"] for r in measured], [r["memory_peak_bytes"] / mib for r in measured], s=14,
               color="tab:blue", label="measured (allocator)", zorder=3)
    exchange = [r for r in measured if r.get("exchange_peak_bytes")]
    ax.scatter([r["step"] for r in exchange], [r["exchange_peak_bytes"] / mib for r in exchange], s=10,
               marker="x", color="tab:gray", label="exchange peak")
    worst = max((r.get("memory_error") or 0.0 for r in measured), default=None)
    note = f"worst error {worst:.0%}" if worst is not None else "not measured"
    if budget_bytes is not None:
        ax.axhline(budget_bytes / mib, color="tab:red", linestyle="--", linewidth=1.2,
                   label=f"budget (memory_per_rank) {budget_bytes / mib:,.0f} MiB")
    ax.set(title=f"peak memory per rank (largest rank)\n{note}", xlabel="step", ylabel="MiB")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.05)
    ax.legend(fontsize=8)
