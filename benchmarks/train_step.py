"""Training iterations on local gloo ranks: Hydraulis against the best homogeneous deployment, measured in one run.

Three ratios, every number measured here in the same job (CPU figures are informative: 4 ranks
share this machine's cores):

1. tokens/s of the same model on the same ranks and global batches, planned by Hydraulis on its
   pool against the best MEASURED homogeneous deployment of that pool: each homogeneous deployment
   runs the same batches through the same Trainer (planned by `Planner.plan_on`), interleaved with
   Hydraulis (`for rep: for variant: all batches`, one warm-up pass each first), and the one with
   the highest median tokens/s is the baseline;
2. the optimizer's gather plus reduce per iteration against a DDP-style all-reduce of the same
   model's gradients;
3. an iteration that switches deployment against one that does not (same batch, same deployment,
   only the previous iteration differs);
4. Hydraulis's plans with the exchange overlapped with compute (runtime/optimizer/exchange.py, the default)
   against the same plans with the whole gather before compute and the whole reduce after it
   (`[parallel] overlap_exchange = false`), interleaved with the rest: tokens/s and the exchange
   time compute did not hide (`StepMetrics.exchange_exposed_s`, the slowest rank's, per iteration).

benchmarks/peers.py compares Hydraulis with transformers' model under DDP and FSDP2 as well.

    .venv/bin/python benchmarks/train_step.py [--steps 10] [--reps 3] [--corpus bbc-news] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from hydraulis.cost import load_cost_model
from hydraulis.data.builtin import ensure_builtin
from hydraulis.data.sampler import TokenBudgetSampler
from hydraulis.planner.planner import Planner
from hydraulis.planner.pool import parse_pool
from hydraulis.specs import ClusterSpec, get_model

WORLD = 4
POOL = "4x(tp1,pp1); 2x(tp2,pp1); 1x(tp2,pp1) + 2x(tp1,pp1)"  # as benchmarks/peers.py
SEQUENTIAL = "hydraulis, exchange not overlapped"


def trainer_settings(job: dict, overlap: bool = True):
    """The trainer's settings, the exchange beside compute or not (the cost model's replica times included)."""
    from hydraulis.optim import OptimSettings
    from hydraulis.settings import ParallelSettings, TrainerSettings, TrainSettings

    return TrainerSettings(model=job["spec"], parallel=ParallelSettings.of(job["pool"], job["cost"], overlap),
                           optim=OptimSettings(lr=1e-3, warmup=2), train=TrainSettings(steps=job["steps"]))


def worker(job: dict) -> dict:
    import torch
    import torch.distributed as dist

    from hydraulis.data.indexed import open_corpus
    from hydraulis.runtime.optimizer.exchange import reduce as reduce_all
    from hydraulis.runtime.parallelism.launch import init_distributed
    from hydraulis.runtime.trainer import Trainer

    env = init_distributed("cpu")
    corpus = open_corpus(job["corpus"])
    settings = trainer_settings(job)
    sampler = TokenBudgetSampler(corpus.lengths, 2048, 1024, seed=1)
    trainer = Trainer(settings=settings, corpus=corpus, sampler=sampler, env=env)
    batches = job["batches"]
    variants = [(name, plans, True) for name, plans in job["plans"].items()]
    variants.append((SEQUENTIAL, job["plans"]["hydraulis"], False))
    out: dict = {"tokens_per_s": {name: [] for name, _, _ in variants}, "exposed_s": {n: [] for n, _, _ in variants}}
    for _, plans, overlap in variants:  # one warm-up pass each
        trainer.settings = trainer_settings(job, overlap)
        for b, p in zip(batches, plans, strict=True):
            trainer.run_iteration(b, p)
    for _ in range(job["reps"]):  # interleaved: a slow spell of the machine hits every variant alike
        for name, plans, overlap in variants:
            trainer.settings = trainer_settings(job, overlap)
            rows = [trainer.run_iteration(b, p) for b, p in zip(batches, plans, strict=True)]
            out["tokens_per_s"][name].append(sum(r.tokens for r in rows) / sum(r.iteration_s for r in rows))
            out["exposed_s"][name].append(statistics.fmean(r.exchange_exposed_s for r in rows))
    trainer.settings = settings

    def timed(fn, repeats: int = 9) -> float:
        """Median over repeats, each started together after a barrier (in training, gather and reduce
        also absorb the wait for the slowest rank, which is imbalance, not exchange cost)."""
        times = []
        for _ in range(repeats):
            dist.barrier()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    # The optimizer's exchanges on each deployment of the pool, against a DDP-style all-reduce of
    # the whole model's fp32 gradients on every rank.
    flat = torch.zeros(trainer.optimizer.layout.total)
    out["allreduce_s"] = timed(lambda: dist.all_reduce(flat))
    out["exchange_s"] = {}
    for index, part in enumerate(trainer.deployments.parts):
        trainer.deployments.activate(index)
        for p in part.params:
            p.grad = torch.ones_like(p)
        gather = timed(lambda part=part: trainer.deployments.gather(part))
        opt = trainer.optimizer
        reduce = timed(lambda part=part, opt=opt: reduce_all(opt, part.exchange_plan, part.grads,
                                                             unscale=part.grad_unscales))
        out["exchange_s"][str(part.deployment)] = gather + reduce
        for p in part.params:
            p.grad = None
    # Switch cost: the same batch on deployment A, after A (no switch) or after B (a switch).
    a, b = job["switch_plans"]
    stay, switch = [], []
    for _ in range(5):
        trainer.run_iteration(batches[0], a)
        stay.append(trainer.run_iteration(batches[0], a).iteration_s)
        trainer.run_iteration(batches[0], b)
        switch.append(trainer.run_iteration(batches[0], a).iteration_s)
    out["stay_s"], out["switch_s"] = statistics.median(stay), statistics.median(switch)
    trainer.close()
    return out


def print_report(report: dict, r: dict, used: dict, args: argparse.Namespace) -> None:
    """The report's lines on the terminal."""
    tput, exposed, best = report["tokens_per_s"], report["exchange_exposed_s"], report["baseline"]
    print(f"train_step on {WORLD} gloo ranks, tiny model, {args.steps} batches of {args.corpus} x {args.reps} reps "
          "(CPU: informative)")
    for k, v in r["tokens_per_s"].items():
        homog = k not in ("hydraulis", SEQUENTIAL)
        label = f"{k} (homogeneous{', best measured' if k == best else ''})" if homog else k
        print(f"  {label:<40} {tput[k]:>8,.0f} tokens/s [{min(v):,.0f}-{max(v):,.0f}]   "
              f"exposed exchange {exposed[k] * 1e3:6.1f} ms/it   "
              f"deployments {', '.join(used.get(k, used['hydraulis']))}")
    print(f"  overlapped / not overlapped exchange: {report['overlap_speedup']:.2f}x tokens/s, exposed exchange "
          f"{exposed['hydraulis'] * 1e3:.1f} against {exposed[SEQUENTIAL] * 1e3:.1f} ms/it")
    print(f"  hydraulis / best measured homogeneous ({best}): {report['speedup_vs_best_homogeneous']:.2f}x measured "
          f"({report['predicted_speedup']:.2f}x predicted by the cost model)")
    for k, v in report["exchange_s"].items():
        print(f"  optimizer gather+reduce on {k}: {v * 1e3:.1f} ms vs DDP all-reduce "
              f"{report['allreduce_s'] * 1e3:.1f} ms: {report['exchange_vs_allreduce'][k]:.2f}x")
    print(f"  iteration after a switch {report['iteration_switch_s']:.3f} s vs without {report['iteration_stay_s']:.3f}"
          f" s: {report['switch_vs_stay']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--corpus", default="bbc-news")
    parser.add_argument("--profile", default="tiny@cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from hydraulis.runtime.parallelism.launch import spawn

    spec = get_model("tiny")
    cost = load_cost_model(args.profile)
    cluster = ClusterSpec(WORLD, WORLD)
    pool = parse_pool(POOL, cluster)
    corpus = ensure_builtin(args.corpus, "bytes")
    batches = TokenBudgetSampler(corpus.lengths, 2048, 1024, seed=1).batches(args.steps)
    lengths = [b.lengths for b in batches]
    planner = Planner(cost, WORLD, pool)
    plans = {"hydraulis": [planner.plan(x, i) for i, x in enumerate(lengths)]}
    homogeneous = [str(d) for d in pool if d.is_homogeneous]
    for d in pool:
        if d.is_homogeneous:
            plans[str(d)] = [planner.plan_on(x, d, i) for i, x in enumerate(lengths)]
    switch_plans = [planner.plan_on(lengths[0], d) for d in (pool[0], pool[-1])]
    job = {
        "spec": spec,
        "cost": cost,
        "pool": pool,
        "corpus": str(corpus.path),
        "batches": batches,
        "plans": plans,
        "switch_plans": switch_plans,
        "steps": args.steps,
        "reps": args.reps,
    }
    start = time.perf_counter()
    r = spawn(worker, WORLD, job)[0]
    tput = {k: statistics.median(v) for k, v in r["tokens_per_s"].items()}
    exposed = {k: statistics.median(v) for k, v in r["exposed_s"].items()}
    best = max(homogeneous, key=tput.get)  # the baseline: the best homogeneous deployment as measured
    predicted = {k: float(np.sum([p.predicted_time_s for p in v])) for k, v in plans.items()}
    used = {k: sorted({str(p.deployment) for p in v}) for k, v in plans.items()}
    report = {
        "world": WORLD,
        "steps": args.steps,
        "reps": args.reps,
        "corpus": args.corpus,
        "profile": args.profile,
        "pool": POOL,
        "tokens_per_s": tput,
        "tokens_per_s_reps": r["tokens_per_s"],
        "exchange_exposed_s": exposed,
        "overlap_speedup": tput["hydraulis"] / tput[SEQUENTIAL],
        "baseline": best,
        "speedup_vs_best_homogeneous": tput["hydraulis"] / tput[best],
        "predicted_speedup": predicted[best] / predicted["hydraulis"],
        "deployments": used,
        "exchange_s": r["exchange_s"],
        "allreduce_s": r["allreduce_s"],
        "exchange_vs_allreduce": {k: v / r["allreduce_s"] for k, v in r["exchange_s"].items()},
        "iteration_stay_s": r["stay_s"],
        "iteration_switch_s": r["switch_s"],
        "switch_vs_stay": r["switch_s"] / r["stay_s"],
        "wall_s": time.perf_counter() - start,
    }
    print_report(report, r, used, args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
