"""Tables and plots of benchmark results (matplotlib is imported only to plot, with Agg)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table


def bench_table(report: dict) -> Table:
    t = Table(title="hydraulis bench (simulated; same cost model and batches for every policy)", title_justify="left")
    for i, col in enumerate(["scenario", "policy", "tokens/s", "vs megatron", "balance eff.", "plan ms/iter"]):
        t.add_column(col, justify="left" if i < 2 else "right")
    last = None
    for r in report["results"]:
        t.add_row(
            r["scenario"] if r["scenario"] != last else "",
            r["policy"],
            f"{r['tokens_per_s']:,.0f}",
            f"{r['speedup_vs_megatron']:.2f}x",
            f"{r['balance_efficiency']:.3f}",
            f"{r['planning_ms']:.1f}",
        )
        last = r["scenario"]
    return t


def summary_lines(report: dict) -> list[str]:
    s = report["summary"]
    names = {
        "min_balance_efficiency": ("hydraulis balance efficiency, worst scenario", "{:.3f}", "target >= 0.92"),
        "speedup_vs_reference_geomean": ("hydraulis vs hydraulis-reference, geometric mean", "{:.3f}x", ">= 1.1x"),
        "speedup_vs_reference_min": ("hydraulis vs hydraulis-reference, worst scenario", "{:.3f}x", ">= 0.99x"),
        "speedup_vs_megatron_min_long": (
            "hydraulis vs megatron, worst scenario with max length >= 16K",
            "{:.2f}x",
            ">= 1.3x",
        ),
        "max_planning_ms": ("hydraulis planning per iteration, worst scenario", "{:.1f} ms", ""),
    }
    return [f"{label}: {fmt.format(s[k])}  {target}".rstrip() for k, (label, fmt, target) in names.items() if k in s]


def bench_plot(report: dict, path: str | Path) -> None:
    """Grouped bars: throughput relative to megatron, per scenario and policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    scenarios = [s["name"] for s in report["scenarios"]]
    policies = report["policies"]
    value = {(r["scenario"], r["policy"]): r["speedup_vs_megatron"] for r in report["results"]}
    x = np.arange(len(scenarios))
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(scenarios)), 4.5))
    for k, p in enumerate(policies):
        ax.bar(x + (k - (len(policies) - 1) / 2) * width, [value.get((s, p), 0) for s in scenarios], width, label=p)
    ax.set_xticks(x, scenarios, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("throughput vs megatron")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.legend(fontsize=8, ncols=3)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
