"""Context parallelism: hydraulis with CP replicas against today's planner (which splits documents) and
megatron with static CP, on the same documents.

Cost models: the shipped A800 profiles of LLaMA 7B, 13B and 32B, and their analytic extension to
CP (`NAME+cp`: a / cp and b / cp of the measured (tp, pp), plus the K/V all-gather at NVLink or NIC
bandwidth; NOT measured). Lengths: the built-in python-stdlib corpus (GPT-2 tokens; about 6% of
its documents are over 32K, the longest 414K), documents over max_len split at max_len. Each global
batch holds max(16K x GPUs, 2 x max_len) tokens.

Three systems on the same documents of the same batches, in the same run:

- hydraulis+cp: the +cp profile; documents up to max_len stay whole (--overlong auto), the pool is
  proposed from other batches of the same data;
- split: today's planner on the measured profile; documents longer than its largest cap are split
  into pieces of that cap (--overlong split), a pool proposed the same way;
- megatron-cp: megatron on the +cp profile, i.e. every replica the same (tp, pp, cp), the cheapest
  static config that holds max_len, documents packed by tokens in data order.

and, to tell the effects of CP apart, hydraulis on a +cp profile with only the CP configs whose cap
is above every TP x PP cap ("beyond"): the extension prices CP configs below measured TP configs of
the same GPUs (b / cp scales perfectly where measured TP does not), so hydraulis+cp also uses small
CP configs where they merely pay. "beyond" / split is what large CP replicas gain: whole documents,
and CP instead of cross-node TP (tp16) for the longest ones.

Throughput is predicted tokens per second (simulated iterations); the ratios are what to read.
Splitting trains on different sequences (no attention across pieces), so split's throughput is not
the same work: it is what keeping whole documents costs, or saves, against it.

Run: .venv/bin/python benchmarks/context_parallel.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import NamedTuple

import numpy as np

from hydraulis.baselines import make_policy
from hydraulis.bench import corpus_source
from hydraulis.cost import extend_to_cp, load_cost_model
from hydraulis.cost.model import CostModel
from hydraulis.data.workload import sample_batches
from hydraulis.errors import HydraulisError
from hydraulis.planner.planner import apply_overlong
from hydraulis.planner.policy import Policy, PolicyContext
from hydraulis.planner.pool import largest_cap
from hydraulis.specs import ClusterSpec

K = 1024
PROFILES = ("llama-7b@a800-80g", "llama-13b@a800-80g", "llama-32b@a800-80g")
GPU_COUNTS = (64, 256, 1024)
MAX_LENS = (32 * K, 128 * K, 256 * K)
CORPUS = "python-stdlib"


class Result(NamedTuple):
    tokens_per_s: float
    deployments: tuple[str, ...]
    cp_token_share: float  # share of the tokens that ran on CP replicas
    planning_s: float  # the slowest iteration's planning time


def measure(policy: Policy, batches: list[np.ndarray]) -> Result:
    schedules = [policy.schedule(b) for b in batches]
    plans = [p for s in schedules for p in s.phases]  # a schedule in phases runs each of them
    tokens = sum(int(b.sum()) for b in batches)
    on_cp = 0
    for p in plans:
        for replica, rp in zip(p.deployment.replicas, p.replicas, strict=True):
            if replica.config.cp > 1:
                on_cp += sum(p.lengths[i] for mb in rp.micro_batches for i in mb)
    deployments = tuple(dict.fromkeys(" | ".join(str(p.deployment) for p in s.phases) for s in schedules))
    slowest = max(s.planning_time_s for s in schedules)
    return Result(tokens / sum(s.iteration_time_s for s in schedules), deployments, on_cp / tokens, slowest)


def split(batches: list[np.ndarray], cost: CostModel, cluster: ClusterSpec) -> list[np.ndarray]:
    cap, name = largest_cap(cost, cluster)
    return [apply_overlong(b, cap, name, "split").lengths for b in batches]


def run(profile: str, num_gpus: int, max_len: int, fresh: int, samples: int) -> dict:
    cluster = ClusterSpec(num_gpus)
    plain, with_cp = load_cost_model(profile), load_cost_model(profile + "+cp")
    tokens_per_batch = max(16 * K * num_gpus, 2 * max_len)
    lengths, counts = corpus_source(CORPUS)(max_len)
    test = sample_batches(lengths, counts, tokens_per_batch, fresh, seed=1)
    train = sample_batches(lengths, counts, tokens_per_batch, samples, seed=1001)
    row: dict = {"profile": profile, "gpus": num_gpus, "max_len": max_len, "tokens_per_batch": tokens_per_batch}
    start = time.perf_counter()
    try:
        ctx = PolicyContext.build(with_cp, cluster, test, sample=train)
        row["hydraulis+cp"] = measure(make_policy("hydraulis", ctx), test)
        row["megatron-cp"] = measure(make_policy("megatron", ctx), test)
    except HydraulisError as exc:
        row["error"] = str(exc)
        return row
    plain_cap = largest_cap(plain, cluster)[0]
    beyond = extend_to_cp(plain, only=lambda g: with_cp.cap(g, num_gpus) > plain_cap)
    row["beyond"] = measure(make_policy("hydraulis", PolicyContext.build(beyond, cluster, test, sample=train)), test)
    split_test = split(test, plain, cluster)
    split_ctx = PolicyContext.build(plain, cluster, split_test, sample=split(train, plain, cluster))
    row["split"] = measure(make_policy("hydraulis", split_ctx), split_test)
    row["split_cap"] = largest_cap(plain, cluster)
    row["seconds"] = time.perf_counter() - start
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="LLaMA 7B on 64 GPUs at 32K and 256K, two batches")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if args.quick:
        grid = [(PROFILES[0], 64, m) for m in (32 * K, 256 * K)]
        fresh, samples = 2, 2
    else:
        grid = [(p, n, m) for p in PROFILES for n in GPU_COUNTS for m in MAX_LENS]
        fresh, samples = 3, 4
    print(f"{CORPUS} lengths; profiles extended to CP analytically (+cp); predicted tokens/s, same batches")
    header = f"{'profile':20s} {'GPUs':>5s} {'max_len':>7s} {'hydraulis+cp':>13s} {'vs split':>9s} {'vs meg-cp':>9s}"
    print(header + f" {'on CP':>6s} {'plan s':>6s} {'beyond/split':>12s} {'on CP':>6s}  megatron-cp config")
    rows, vs_split, vs_megatron, beyond_split = [], [], [], []
    for profile, n, m in grid:
        row = run(profile, n, m, fresh, samples)
        rows.append(row)
        label = f"{profile:20s} {n:>5d} {m // K:>6d}K"
        if "error" in row:
            print(f"{label} does not fit: {row['error']}", flush=True)
            continue
        ours, theirs, meg, big = row["hydraulis+cp"], row["split"], row["megatron-cp"], row["beyond"]
        vs_split.append(ours.tokens_per_s / theirs.tokens_per_s)
        vs_megatron.append(ours.tokens_per_s / meg.tokens_per_s)
        beyond_split.append(big.tokens_per_s / theirs.tokens_per_s)
        print(
            f"{label} {ours.tokens_per_s:>13,.0f} {vs_split[-1]:>8.3f}x {vs_megatron[-1]:>8.3f}x "
            f"{ours.cp_token_share:>6.1%} {ours.planning_s:>6.2f} {beyond_split[-1]:>11.3f}x "
            f"{big.cp_token_share:>6.1%}  {meg.deployments[0]}  ({row['seconds']:.0f} s)",
            flush=True,
        )
    if vs_split:

        def gm(x: list[float]) -> str:
            return f"{float(np.exp(np.mean(np.log(x)))):.3f}x (min {min(x):.3f}x, max {max(x):.3f}x)"

        print(f"geomean: vs split {gm(vs_split)}; vs megatron-cp {gm(vs_megatron)}; beyond vs split {gm(beyond_split)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            out = [{k: v._asdict() if isinstance(v, Result) else v for k, v in r.items()} for r in rows]
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
