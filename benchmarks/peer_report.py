"""The tables of benchmarks/peers.py: per variant throughput, memory, exchange and CPU figures, and the ratios.

A separate module so that peers.py stays short. Under a memory budget (the `bounded` setting) every
variant's measured peak per rank is printed beside the budget, and a variant over it is reported as not
fitting: its throughput is shown for information, never as a result, and no ratio is taken against it.
"""

from __future__ import annotations

import statistics
from typing import Any

MiB = 2**20


def breakdown(parts: list[dict]) -> dict[str, float]:
    """Median seconds per step of Hydraulis's phases on rank 0. Compute is the slowest replica's (rank 0's
    reduce waits for it); the rest is the reduce's exchange, the norm all-reduce and AdamW after it."""
    rows = [{"iteration": p["iteration_s"], "switch": p["switch_s"], "gather": p["gather_s"],
             "compute_slowest": max(p["replica_s"]), "compute_mean": statistics.fmean(p["replica_s"]),
             "reduce_norm_adamw": p["iteration_s"] - p["switch_s"] - p["gather_s"] - max(p["replica_s"])}
            for p in parts]
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def print_report(summary: dict[str, Any]) -> None:
    var = summary["variants"]
    budget = summary.get("budget_bytes")
    print(f"  {'variant':<20} {'tokens/s median [min-max]':>32} {'predicted':>10} {'peak MiB':>9} {'peak +MiB':>10}"
          f" {'sent MiB/it':>12} {'exposed s/it':>16} {'CPU s/it':>9} {'cores busy':>10} {'first loss':>11}")
    for v, r in var.items():
        spread = f"{r['tokens_per_s_median']:,.0f} [{r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f}]"
        pred = f"{r['predicted_tokens_per_s']:,.0f}" if r["predicted_tokens_per_s"] else "-"
        exposed = f"{r['exposed_s_per_iteration']:.3f} ({r['exposed_share']:.0%})"
        flag = "" if r.get("fits", True) else "  DOES NOT FIT the budget"
        print(f"  {v:<20} {spread:>32} {pred:>10} {r['peak_mib']:>9.1f} {r['peak_increase_mib']:>10.1f}"
              f" {r['sent_mib_per_iteration']:>12.2f} {exposed:>16} {r['cpu_s_per_iteration']:>9.3f}"
              f" {r['core_utilisation']:>10.0%} {r['first_loss']:>11.7f}{flag}")
    print("  peak MiB: the largest rank's peak of tensor bytes (a census of live tensors before each step plus the"
          " allocator's peak in it, warm-up pass)" + (f"; budget {budget / MiB:.1f} MiB per rank" if budget else ""))
    for d, why in summary.get("unplannable", {}).items():
        print(f"  {d:<20} does not fit the budget: {why}")
    print("  exposed s/it: the rank that waited longest (it includes waiting for slower ranks); the rank that"
          " waited least: " + ", ".join(f"{v} {r['exposed_min_rank_s_per_iteration']:.3f}" for v, r in var.items()))
    used = ", ".join(f"{d} x{n}" for d, n in summary["hydraulis_deployments"].items())
    print(f"  hydraulis chose: {used}")
    for v, r in var.items():
        if "breakdown_s" in r:
            b = r["breakdown_s"]
            print(f"  {v:<20} median step {b['iteration']:.3f} s: switch {b['switch']:.3f}, gather {b['gather']:.3f},"
                  f" compute {b['compute_slowest']:.3f} (slowest replica; mean {b['compute_mean']:.3f}),"
                  f" reduce+norm+AdamW {b['reduce_norm_adamw']:.3f}")
    best = summary["best_homogeneous_measured"]
    if best is not None:
        print(f"  speedup over the best homogeneous{' that fits' if budget else ''}: predicted "
              f"{summary['predicted_speedup']:.2f}x (over {summary['best_homogeneous_predicted']}), measured "
              f"{summary['ratios'][f'hydraulis/{best}']:.2f}x (over {best}, best measured)")
    print("  " + "   ".join(f"{k} {x:.2f}x" for k, x in summary["ratios"].items()))
    if "predicted_policy_speedup" in summary:
        print(f"  memory policies per micro-batch: predicted {summary['predicted_policy_speedup']:.2f}x over off")
    print("  against hydraulis, |loss difference| at the first step (relative grad-norm difference) and the last:")
    print("    " + ", ".join(f"{v} {d['first_loss_diff']:.1e} ({d['first_grad_norm_rel_diff']:.1e}) "
                           f"{d['last_loss_diff']:.1e}" for v, d in summary["agreement"].items()))
