"""The chunked-sequence oracle on the bench's long scenarios (issue 42, item 3; `cost/chunks.py`).

Per scenario, on the bench's own batches and cost model (recompute where nothing holds the longest
sequence otherwise, CP configs for all): the bound of `planner/bounds.py` without and with chunks, their
ratio (the most chunking could gain if plans came as close to either bound), and for the longest sequence
the chunked config of least work and its chunk. With `--bench bench.json` (a `hydraulis bench` run) also
hydraulis's efficiency against each bound, and what hydraulis would reach at the same efficiency with
chunks. Simulated and analytic: load does not move the figures.

    PYTHONPATH=src python benchmarks/chunk_oracle.py [--bench bench-out/bench.json] [SCENARIO ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from hydraulis.bench import get_scenarios
from hydraulis.cost import load_cost_model
from hydraulis.cost.chunks import chunk_sizes, chunked_stage_time
from hydraulis.planner.bounds import lower_bound
from hydraulis.planner.policy import PolicyContext
from hydraulis.specs import ClusterSpec


def longest_chunked(cost, num_gpus: int, longest: int) -> str:
    """The config on which the longest sequence's chunks take the least GPU time, and its chunk."""
    configs = [g for g in cost.configs if g.num_gpus <= num_gpus]
    one = np.array([longest])
    gpu_s = chunked_stage_time(cost, configs, num_gpus, one)[:, 0] * np.array([g.num_gpus for g in configs])
    if not np.isfinite(gpu_s).any():
        return "no config runs it in busy chunks beside its K/V"
    k = int(np.argmin(gpu_s))
    return f"{configs[k].name} in chunks of {int(chunk_sizes(cost, configs[k : k + 1], num_gpus, one)[0, 0]):,}"


def main(args: list[str]) -> int:
    bench = None
    if "--bench" in args:
        i = args.index("--bench")
        bench = json.loads(Path(args[i + 1]).read_text())
        args = args[:i] + args[i + 2 :]
    times = {}
    if bench:
        times = {(r["scenario"], r["policy"]): r["iteration_times_s"] for r in bench["results"]}
    ratios = []
    for s in get_scenarios(args or None, None if args else "long"):
        cost = load_cost_model(s.profile)
        batches = s.sample(s.seed)
        ctx = PolicyContext.build(cost, ClusterSpec(s.num_gpus), batches, sample=s.sample(s.seed + 1000, 4))
        own = ctx.recompute_where_needed(lone=False).cost
        plain = np.array([lower_bound(b, own, s.num_gpus) for b in batches])
        chunked = np.array([lower_bound(b, own, s.num_gpus, chunked=True) for b in batches])
        ratio = float(plain.sum() / chunked.sum())
        ratios.append(ratio)
        line = (f"{s.name}: bound without / with chunks {ratio:.3f}x; longest {ctx.run_max_length:,}: "
                f"{longest_chunked(own, s.num_gpus, ctx.run_max_length)}")
        if (ours := times.get((s.name, "hydraulis"))) is not None:
            t = float(np.sum(ours))
            line += (f"; hydraulis's efficiency {plain.sum() / t:.2f} (plain bound), {chunked.sum() / t:.2f} "
                     f"(with chunks)")
        print(line, flush=True)
    print(f"geometric mean of the bound ratios: {float(np.exp(np.mean(np.log(ratios)))):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
