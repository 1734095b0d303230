"""Hydraulis against plain PyTorch peers: the same global batches on 4 gloo ranks, measured side by side.

The project's yardstick for training speed. Variants, on the same global batches of a built-in corpus:

- `hydraulis`: the real Trainer with its Planner on POOL, plans made up front as benchmarks/train_step.py does;
- each homogeneous deployment of the pool (`4x(tp1,pp1)`, `2x(tp2,pp1)`): the same Trainer on it alone;
- `ddp-doc`, `ddp-packed`: torch DDP of transformers' LlamaForCausalLM, one forward per document,
  or one packed row per rank with a block-diagonal causal mask; `fsdp2`: FSDP2, one forward per
  document. benchmarks/peer_models.py says how they train Hydraulis's exact objective (same weights,
  loss, AdamW, clipping) and how documents are split over ranks (greedy by tokens, in batch order).

Setting `bounded`: memory binds, as on GPUs. Every rank may hold 36 MiB of tensors (`[parallel]
memory_per_rank`, emulated: the caps are computed for it, in fp32), and a tp1 replica does not hold the
longest documents. The baselines, on the same batches, are what a user of a homogeneous system does then:
each homogeneous deployment of the pool that holds every batch of an epoch of the data (a user picks one
for the whole run; the others are listed with the planner's reason); `4x(tp1,pp1) recompute`, Hydraulis's
runtime with every tp1 replica recomputing its activations; `ddp-doc-gc`, DDP of transformers' model with
its activation checkpointing; `fsdp2-ac`, FSDP2 with the same; and `ddp-doc`, which does not fit (for
scale). Under a budget `hydraulis` chooses a memory policy per micro-batch (none, selective or full
recompute: `CostModel.with_policies`) and `hydraulis policies off` does not. Setting `tight`: the same at
28 MiB, without `ddp-doc`. Every variant's measured peak per rank is printed beside the budget; one over
it is flagged as not fitting and no ratio is taken against it.

Measurement. `for rep in range(reps): for variant in variants:` a fresh job of 4 processes builds the
variant, runs one warm-up pass over the batches, then the timed pass. Every step starts after a
barrier; its time is the slowest rank's, from the step's start to the end of that rank's optimizer
step (Hydraulis: `StepMetrics.iteration_s`, which ends there too; its per-step reporting is left
out). tokens/s = the batches' real tokens / the summed step times; median [min-max] over reps.

CPU seconds per iteration: every rank's process CPU time over the timed pass, summed over ranks; over
the wall time and the cores, the share of the machine the variant kept busy (near 100%: only less work
can be faster here).

Memory per rank: VmHWM minus VmRSS after the imports and before the variant is built (what the variant
added at its peak; each variant runs in processes of its own), the largest rank, median of reps. Beside it,
"peak MiB": the most tensor bytes a rank held in any warm-up step, measured as the trainer measures its own
(runtime/metering/step_memory.py; the timed pass runs without the profiler). The budget is checked on it.

Exposed exchange time per iteration: the seconds a rank's training thread waited for the exchange of
parameters and gradients instead of computing (Hydraulis: runtime/optimizer/exchange.py's figure; DDP:
the tail of its backward after the last gradient; FSDP2: its blocking all-gathers and reduce-scatters;
benchmarks/peer_models.py says why these measure the same thing), largest rank per step, mean over steps;
the rank that waited least, whose wait is the exchange alone, is printed too. Bytes sent per rank per
iteration: DDP and FSDP2 by the ring formula, Hydraulis from its exchange plans (TP's all-reduces inside
compute not counted). The planner's predicted speedup over the best homogeneous deployment is printed next
to the measured one. CPU figures are informative: the 4 ranks share this machine's cores.

    .venv/bin/python benchmarks/peers.py [--setting all|longtail|sft|small|bounded|tight] [--reps 3] [--steps 12]
        [--tokens N] [--profile P] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any, NamedTuple

import numpy as np
from peer_models import CHECKPOINTED, PEERS, build_peer, rank_documents, scalar, split_by_tokens, status_bytes
from peer_report import breakdown, print_report

from hydraulis.cost import load_cost_model
from hydraulis.cost.model import CostModel
from hydraulis.data.builtin import ensure_builtin
from hydraulis.data.sampler import TokenBudgetSampler
from hydraulis.errors import HydraulisError
from hydraulis.limits import parse_size
from hydraulis.optim import OptimSettings
from hydraulis.parallel import ParallelConfig
from hydraulis.planner.planner import Planner
from hydraulis.planner.pool import check_job_pool, parse_pool
from hydraulis.runtime.optimizer.layout import ShardLayout
from hydraulis.runtime.parallelism.batch import count_targets
from hydraulis.specs import ClusterSpec, ModelSpec, get_model

WORLD = 4
POOL = "4x(tp1,pp1); 2x(tp2,pp1); 1x(tp2,pp1) + 2x(tp1,pp1)"
SEED = 1  # sampler order and initial weights (TrainSettings.seed's default)
MiB = 2**20


class Setting(NamedTuple):
    model: str
    corpus: str
    tokenizer: str
    max_len: int
    tokens: int  # per global batch
    profile: str  # the default cost model
    about: str
    pool: str = POOL
    overlong: str = "split"  # the sampler's policy for documents longer than max_len
    budget: str | None = None  # memory per rank ([parallel] memory_per_rank); the runs are fp32
    peers: tuple[str, ...] = PEERS


RECOMPUTE = "4x(tp1,pp1) recompute"  # Hydraulis's own runtime, every tp1 replica recomputing its activations
OFF = "hydraulis policies off"  # under a budget: Hydraulis without a memory policy per micro-batch


SETTINGS = {
    "longtail": Setting("tiny", "bbc-news", "bytes", 2048, 8192, "tiny@cpu-measured",
                        "BBC articles as bytes, pieces up to 2,048 (p10 417, p50 1,633, 36% at the cap)"),
    "sft": Setting("tiny", "bbc-news", "bytes", 512, 4096, "tiny@cpu-measured",
                   "short sequences: BBC articles as bytes in pieces up to 512"),
    "small": Setting("small", "bbc-news", "gpt2", 2048, 4096, "small@cpu",
                     "GPT-2 tokens of BBC articles (p50 422, p90 776, up to 2,048)"),
    # Memory binds: at 36 MiB per rank a tp1 replica holds 1,536 tokens, tp1pp2 1,664 in each of several
    # micro-batches and 2,816 in a lone one, tp2pp1 2,560 (`hydraulis caps -p tiny@cpu-measured -n 4
    # --memory-per-rank 36MiB --dtype fp32`); CPython's files up to 2,048 bytes, longer ones left out.
    "bounded": Setting("tiny", "python-stdlib", "bytes", 2048, 6144, "tiny@cpu-measured",
                       "CPython's .py files as bytes, those up to 2,048 (p10 61, p50 715, p90 1,640)",
                       "2x(tp2,pp1); 2x(tp1,pp2); 1x(tp1,pp2) + 2x(tp1,pp1); 4x(tp1,pp1); "
                       "1x(tp1,pp2) + 1x(tp2,pp1); 1x(tp2,pp2)",
                       "drop", "36MiB", ("ddp-doc", *CHECKPOINTED)),
}
# Tighter: at 28 MiB tp1 holds 1,152 tokens, tp1pp2 1,280 (2,176 alone), tp2pp1 1,920; with selective recompute
# tp1 holds 1,792 and tp1pp2 1,920 (2,688 alone), with full 2,944 and 3,200 (3,328).
SETTINGS["tight"] = SETTINGS["bounded"]._replace(budget="28MiB", peers=CHECKPOINTED)


# -- the parent: batches, plans, predictions -------------------------------------------------------
def cost_model(profile: str, spec: ModelSpec, pool, lengths: np.ndarray, max_len: int) -> tuple[CostModel, Any]:
    """The named cost model, or with `auto` a profile of the pool's configs measured here first."""
    if profile != "auto":
        return load_cost_model(profile), None
    from hydraulis.cost import ProfiledCostModel
    from hydraulis.cost.sweep import ProfileSettings
    from hydraulis.runtime.metering.profiler import profile_model
    from hydraulis.training.auto_profile import (
        _sweep_for,  # the sweep of `profile = "auto"`: this data's lengths up to max_len
    )

    configs = sorted({g for d in pool for g in d.configs}, key=lambda g: (g.num_gpus, g.tp, g.pp))
    print(f"  profiling {spec.name} ({', '.join(g.name for g in configs)}) on {WORLD} CPU ranks ...", flush=True)
    data = profile_model(spec, configs, WORLD, "cpu", ProfileSettings(**_sweep_for(max_len, lengths)))
    return ProfiledCostModel.from_dict(data, "auto"), data


def exchange_bytes(spec: ModelSpec, plans) -> float:
    """Hydraulis's optimizer gather + reduce, bytes sent per iteration by the busiest rank (fp32 both ways)."""
    from hydraulis.runtime.optimizer.sharded import ExchangePlan

    layout, per_deployment = ShardLayout(spec, WORLD), {}
    for d in {p.deployment for p in plans}:
        sent = [ExchangePlan.build(layout, d, r).traffic() for r in range(WORLD)]
        per_deployment[d] = max(4 * (t["gather_send"] + t["reduce_send"]) for t in sent)
    return float(np.mean([per_deployment[p.deployment] for p in plans]))


def epoch_batches(lengths: np.ndarray, tokens: int, s: Setting) -> list[np.ndarray]:
    """One epoch's global batches of the setting's data (another seed than the measured ones')."""
    sampler = TokenBudgetSampler(lengths, tokens, s.max_len, seed=SEED + 1, policy=s.overlong)
    return [b.lengths for b in sampler.batches(max(1, int(sampler.piece_lengths().sum()) // tokens))]


def unfit_homogeneous(planner: Planner, pool, batches: list[np.ndarray]) -> dict[str, str]:
    """The homogeneous deployments of the pool that cannot run every batch of an epoch within the budget (a
    user of a homogeneous system picks one deployment for the whole run), and why."""
    out = {}
    for d in (d for d in pool if d.is_homogeneous):
        failed = []
        for b in batches:
            try:
                planner.plan_on(b, d)
            except HydraulisError as exc:
                failed.append(str(exc))
        if failed:
            out[str(d)] = f"{len(failed)} of {len(batches)} batches of an epoch, e.g. {failed[0]}"
    return out


def prepare(name: str, args: argparse.Namespace) -> dict[str, Any]:
    s = SETTINGS[name]
    spec = get_model(s.model)
    tokens = args.tokens or s.tokens
    corpus = ensure_builtin(s.corpus, s.tokenizer)
    sampler = TokenBudgetSampler(corpus.lengths, tokens, s.max_len, seed=SEED, policy=s.overlong)
    batches = sampler.batches(args.steps)
    pool = parse_pool(s.pool, ClusterSpec(WORLD, WORLD))
    profile = args.profile or s.profile
    cost, profile_data = cost_model(profile, spec, pool, sampler.piece_lengths(), s.max_len)
    budget = None if s.budget is None else parse_size(s.budget, f"{name}: budget")
    cost = cost.for_job(budget, 4)  # the caps of an fp32 run, within the budget
    check_job_pool(pool, WORLD, spec, cost, s.max_len)
    planner = Planner(cost, WORLD, pool)
    # Under a budget hydraulis chooses a memory policy per micro-batch; OFF and the baselines plan without.
    policies = cost.with_policies(budget is not None)
    plans = {"hydraulis": [Planner(policies, WORLD, pool).plan(b.lengths, i) for i, b in enumerate(batches)]}
    costs = {"hydraulis": policies}
    if budget is not None:
        plans[OFF], costs[OFF] = [planner.plan(b.lengths, i) for i, b in enumerate(batches)], cost
    unplannable = unfit_homogeneous(planner, pool, epoch_batches(corpus.lengths, tokens, s)) if budget else {}
    for d in pool:
        if d.is_homogeneous and str(d) not in unplannable:
            plans[str(d)] = [planner.plan_on(b.lengths, d, i) for i, b in enumerate(batches)]
            costs[str(d)] = cost
    if budget is not None:  # what a user does when a document does not fit: recompute activations
        tp1 = ParallelConfig(1, 1)
        costs[RECOMPUTE] = recompute = cost.with_recompute([tp1])
        every = parse_pool(f"4x({tp1.name[:3]},pp1)", ClusterSpec(WORLD, WORLD))[0]
        plans[RECOMPUTE] = [Planner(recompute, WORLD, (every,)).plan_on(b.lengths, every, i)
                            for i, b in enumerate(batches)]
    params = ShardLayout(spec, 1).total
    ring = 2 * (WORLD - 1) / WORLD * 4 * params
    return {
        "setting": name, "spec": spec, "corpus": str(corpus.path), "tokenizer": s.tokenizer, "max_len": s.max_len,
        "tokens": tokens, "about": s.about, "overlong": s.overlong, "budget": budget, "peers": s.peers,
        "cores": len(os.sched_getaffinity(0)), "profile": profile, "profile_data": profile_data, "costs": costs,
        "pool": pool, "batches": batches, "plans": plans, "optim": OptimSettings(), "params": params,
        "unplannable": unplannable,
        "sent_bytes": {**{v: exchange_bytes(spec, p) for v, p in plans.items()}, **dict.fromkeys(s.peers, ring)},
    }


# -- the ranks: one variant, a warm-up pass and a timed pass ---------------------------------------
def hydraulis_runner(job: dict, variant: str, env, corpus, total_steps: int):
    from hydraulis.runtime.trainer import Trainer
    from hydraulis.settings import ParallelSettings, TrainerSettings, TrainSettings
    plans = job["plans"][variant]
    pool = job["pool"] if variant in ("hydraulis", OFF) else (plans[0].deployment,)
    sampler = TokenBudgetSampler(corpus.lengths, job["tokens"], job["max_len"], seed=SEED, policy=job["overlong"])
    settings = TrainerSettings(model=job["spec"], parallel=ParallelSettings.of(pool, job["costs"][variant]),
                               optim=job["optim"], train=TrainSettings(steps=total_steps))
    trainer, parts = Trainer(settings=settings, corpus=corpus, sampler=sampler, env=env), []

    def step(i: int):
        m = trainer.run_iteration(job["batches"][i], plans[i])
        parts.append({k: getattr(m, k) for k in ("iteration_s", "switch_s", "gather_s", "reduce_s", "replica_s")})
        exposed = trainer.meter.mine.exposed_s  # this rank's own (the metric is already the largest rank's)
        return m.iteration_s, (m.loss if env.rank == 0 else 0.0), m.grad_norm, exposed

    return step, trainer.close, parts


def peer_runner(job: dict, variant: str, env, corpus, total_steps: int):
    peer = build_peer(variant, job["spec"], SEED, job["optim"], total_steps, env.world_size)
    done = [0]

    def step(i: int):
        start = time.perf_counter()
        batch = job["batches"][i]
        total = count_targets(batch.lengths)
        mine = split_by_tokens(batch.lengths, env.world_size)[env.rank]
        loss_sum, norm, exposed = peer.step(rank_documents(batch, corpus, mine), total, done[0])
        done[0] += 1
        return time.perf_counter() - start, loss_sum / total, norm, exposed

    return step, lambda: None, None


def run_pass(step, steps: int, meter: bool = False) -> dict[str, list[float]]:
    """Every step after a barrier; per step the slowest rank's time, the global loss, the grad norm, and
    the exposed exchange (largest over ranks, and this rank's own). `meter`: also each step's peak of tensor
    bytes on this rank, as the trainer measures its own (runtime/metering/step_memory.py): a census of live tensors
    before the step plus the CPU allocator's peak above it, by torch's profiler (it slows the step)."""
    import torch
    import torch.distributed as dist

    from hydraulis.runtime.metering.memory_meter import PeakMeter, live_tensor_bytes

    seconds, cpu, shares, norms, exposed, peaks = [], [], [], [], [], []
    for i in range(steps):
        dist.barrier()
        base = live_tensor_bytes() if meter else 0
        peak = PeakMeter().start() if meter else None
        busy = time.process_time()  # this process's CPU seconds, all its threads
        s, share, norm, waited = step(i)
        cpu.append(time.process_time() - busy)
        if peak is not None:
            peak.stop()
            peaks.append(base + peak.peak_bytes)
        seconds.append(s)
        shares.append(float(share))
        norms.append(scalar(norm))
        exposed.append(float(waited))
    t = torch.tensor(seconds, dtype=torch.float64)
    c = torch.tensor(cpu, dtype=torch.float64)
    losses = torch.tensor(shares, dtype=torch.float64)
    e, e_min = torch.tensor(exposed, dtype=torch.float64), torch.tensor(exposed, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(c)  # CPU seconds of all ranks together
    dist.all_reduce(losses)  # each rank's share of the global loss (Hydraulis: rank 0 holds all of it)
    dist.all_reduce(e, op=dist.ReduceOp.MAX)
    dist.all_reduce(e_min, op=dist.ReduceOp.MIN)
    return {"step_s": t.tolist(), "cpu_s": c.tolist(), "loss": losses.tolist(), "grad_norm": norms,
            "exposed_s": e.tolist(), "exposed_min_s": e_min.tolist(), "exposed_rank_s": exposed,
            "peak_bytes": max(peaks, default=0)}


def worker(job: dict, variant: str) -> dict:
    import transformers  # noqa: F401 - imported before the baseline by every variant alike

    from hydraulis.data.indexed import open_corpus
    from hydraulis.runtime.parallelism.launch import init_distributed

    env = init_distributed("cpu")
    corpus = open_corpus(job["corpus"])
    steps = len(job["batches"])
    base = status_bytes("VmRSS")
    if variant in job["plans"]:
        step, close, parts = hydraulis_runner(job, variant, env, corpus, 2 * steps)
    else:
        step, close, parts = peer_runner(job, variant, env, corpus, 2 * steps)
    warm = run_pass(step, steps, meter=True)  # the warm-up pass measures memory; the timed pass runs bare
    timed = run_pass(step, steps)
    close()
    return {"warm": warm, "timed": timed, "parts": parts[steps:] if parts else None,
            "rss_base": base, "hwm": status_bytes("VmHWM")}


# -- measuring and reporting ---------------------------------------------------------------------
def measure(job: dict, reps: int) -> dict[str, list[dict]]:
    """Interleaved: every variant once per repetition, each in a fresh job of WORLD processes."""
    from hydraulis.runtime.parallelism.launch import spawn

    variants = [*job["plans"], *job["peers"]]
    tokens = sum(b.num_tokens for b in job["batches"])
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    for rep in range(reps):
        for v in variants:
            ranks = spawn(worker, WORLD, {k: x for k, x in job.items() if k != "profile_data"}, v)
            seconds = sum(ranks[0]["timed"]["step_s"])
            rows[v].append({
                "tokens_per_s": tokens / seconds, "seconds": seconds, "step_s": ranks[0]["timed"]["step_s"],
                "cpu_s": sum(ranks[0]["timed"]["cpu_s"]), "exposed_s": ranks[0]["timed"]["exposed_s"],
                "exposed_min_s": ranks[0]["timed"]["exposed_min_s"],
                "exposed_per_rank_s": [statistics.fmean(r["timed"]["exposed_rank_s"]) for r in ranks],
                "loss": ranks[0]["timed"]["loss"], "first_loss": ranks[0]["warm"]["loss"][0],
                "first_grad_norm": ranks[0]["warm"]["grad_norm"][0],
                "peak_increase_bytes": [r["hwm"] - r["rss_base"] for r in ranks],
                "vmhwm_bytes": [r["hwm"] for r in ranks], "hydraulis_parts": ranks[0]["parts"],
                "peak_bytes": [r["warm"]["peak_bytes"] for r in ranks],
            })
            print(f"    rep {rep + 1}/{reps}  {v:<20} {tokens / seconds:>9,.0f} tokens/s", flush=True)
    return rows


def variant_summary(job: dict, v: str, reps: list[dict]) -> dict[str, Any]:
    """One variant's medians over the repetitions (and each repetition's rows)."""
    tokens = sum(b.num_tokens for b in job["batches"])
    tput = [r["tokens_per_s"] for r in reps]
    predicted = sum(p.predicted_time_s for p in job["plans"][v]) if v in job["plans"] else None
    peak = statistics.median(max(r["peak_bytes"]) for r in reps)  # the largest rank's, median of reps
    out = {
        "tokens_per_s_median": statistics.median(tput), "tokens_per_s_min": min(tput),
        "tokens_per_s_max": max(tput), "tokens_per_s": tput,
        "predicted_tokens_per_s": tokens / predicted if predicted else None,
        "cpu_s_per_iteration": statistics.median(r["cpu_s"] for r in reps) / len(job["batches"]),
        # seconds per iteration the exchange kept the slowest-waiting rank from computing, and its share
        "exposed_s_per_iteration": statistics.median(statistics.fmean(r["exposed_s"]) for r in reps),
        "exposed_share": statistics.median(sum(r["exposed_s"]) / r["seconds"] for r in reps),
        # the rank that waited least: the slowest one, whose wait is the exchange alone, without imbalance
        "exposed_min_rank_s_per_iteration": statistics.median(statistics.fmean(r["exposed_min_s"]) for r in reps),
        # the share of the cores busy during the timed pass: 1.0 means no schedule of the same work can
        # be faster here, only less work can
        "core_utilisation": statistics.median(r["cpu_s"] / r["seconds"] for r in reps) / job["cores"],
        "peak_increase_mib": statistics.median(max(r["peak_increase_bytes"]) for r in reps) / MiB,
        "vmhwm_mib": statistics.median(max(r["vmhwm_bytes"]) for r in reps) / MiB,
        # tensor bytes at the peak, the largest rank's (every rank's is in reps), against the budget if any
        "peak_mib": peak / MiB,
        "fits": job["budget"] is None or max(max(r["peak_bytes"]) for r in reps) <= job["budget"],
        "sent_mib_per_iteration": job["sent_bytes"][v] / MiB,
        "first_loss": reps[0]["first_loss"], "first_grad_norm": reps[0]["first_grad_norm"],
        "reps": reps,
    }
    if reps[0]["hydraulis_parts"]:
        out["breakdown_s"] = breakdown([p for r in reps for p in r["hydraulis_parts"]])
    return out


def summarize(job: dict, rows: dict[str, list[dict]]) -> dict[str, Any]:
    out: dict[str, Any] = {"variants": {v: variant_summary(job, v, reps) for v, reps in rows.items()}}
    var = out["variants"]
    # The homogeneous deployments of the pool that fit the budget (all of them without one), measured.
    homog = [v for v in job["plans"] if v not in ("hydraulis", RECOMPUTE, OFF) and var[v]["fits"]]
    best_measured = max(homog, key=lambda v: var[v]["tokens_per_s_median"], default=None)
    best_predicted = max(homog, key=lambda v: var[v]["predicted_tokens_per_s"], default=None)
    hyd = var["hydraulis"]
    out["best_homogeneous_measured"], out["best_homogeneous_predicted"] = best_measured, best_predicted
    out["budget_bytes"], out["unplannable"] = job["budget"], job["unplannable"]
    out["predicted_speedup"] = (hyd["predicted_tokens_per_s"] / var[best_predicted]["predicted_tokens_per_s"]
                                if best_predicted else None)
    # Ratios only against variants that fit the budget: one over it is not a result.
    against = [v for v in [*job["peers"], *(v for v in (RECOMPUTE, OFF) if v in var), best_measured]
               if v is not None and var[v]["fits"]]
    if OFF in var:  # what the memory policies per micro-batch gain, predicted
        out["predicted_policy_speedup"] = hyd["predicted_tokens_per_s"] / var[OFF]["predicted_tokens_per_s"]
    out["ratios"] = {f"hydraulis/{v}": hyd["tokens_per_s_median"] / var[v]["tokens_per_s_median"] for v in against}
    out["not_fitting"] = [v for v in var if not var[v]["fits"]]
    # The same weights, batches and optimizer: losses should agree at the first step (batch 0, initial
    # weights) and still at the last (after 2 x steps optimizer steps), to fp32 rounding. Grad norms
    # agree less on large models: Hydraulis sums squares in fp64, torch's clip_grad_norm_ in fp32
    # (1e-4 apart on small, where fp64 on one process gives Hydraulis's value).
    out["agreement"] = {v: {"first_loss_diff": abs(var[v]["first_loss"] - hyd["first_loss"]),
                            "first_grad_norm_rel_diff": abs(var[v]["first_grad_norm"] / hyd["first_grad_norm"] - 1),
                            "last_loss_diff": abs(var[v]["reps"][0]["loss"][-1] - hyd["reps"][0]["loss"][-1])}
                        for v in var if v != "hydraulis"}
    out["hydraulis_deployments"] = dict(Counter(str(p.deployment) for p in job["plans"]["hydraulis"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", default="all", choices=["all", *SETTINGS])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="global batches per repetition")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per global batch (default: the setting's)")
    parser.add_argument("--profile", default=None,
                        help="cost model for every setting: a profile file, a preset, MODEL@DEVICE or auto "
                             "(default: tiny@cpu-measured for the tiny settings, the analytic small@cpu for small; "
                             "auto profiles the pool's configs here first, over ten minutes for small on 2 cores)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.reps < 1 or args.steps < 1:
        parser.error("--reps and --steps must be at least 1")
    names = list(SETTINGS) if args.setting == "all" else [args.setting]
    report: dict[str, Any] = {"world": WORLD, "reps": args.reps, "steps": args.steps, "settings": {}}
    for name in names:
        start = time.perf_counter()
        s = SETTINGS[name]
        print(f"{name}: {s.model} on {s.about}; {args.tokens or s.tokens:,} tokens per batch, max_len {s.max_len}, "
              f"{args.steps} batches x {args.reps} reps, {WORLD} gloo ranks (CPU: informative)", flush=True)
        try:
            job = prepare(name, args)
        except HydraulisError as exc:
            sys.exit(f"{name}: {exc}")
        budget = f"; {s.budget} per rank (fp32 caps)" if s.budget else ""
        print(f"  cost model {job['profile']}; pool {s.pool}{budget}; {job['params']:,} parameters", flush=True)
        summary = summarize(job, measure(job, args.reps))
        print_report(summary)
        report["settings"][name] = {
            "model": s.model, "corpus": s.corpus, "tokenizer": s.tokenizer, "max_len": s.max_len, "pool": s.pool,
            "overlong": s.overlong, "memory_per_rank": s.budget,
            "tokens_per_batch": job["tokens"], "profile": job["profile"], "parameters": job["params"],
            "batch_lengths": [b.lengths.tolist() for b in job["batches"]],
            "predicted_s": {v: [p.predicted_time_s for p in ps] for v, ps in job["plans"].items()},
            "profile_data": job["profile_data"], "wall_s": time.perf_counter() - start, **summary,
        }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
