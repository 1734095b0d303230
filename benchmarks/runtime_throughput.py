"""Forward+backward tokens/s of the runtime for several parallel configs (informative only).

Each config runs as its own gloo job of tp * pp processes on this machine
(one simulated GPU each). A step is `train_step` over micro-batches of
packed documents of random lengths, without an optimizer; tokens/s counts the
real tokens of one step over its median wall time.

    PYTHONPATH=src .venv/bin/python benchmarks/runtime_throughput.py
    PYTHONPATH=src .venv/bin/python benchmarks/runtime_throughput.py --configs tp1pp1,tp2pp2 --steps 5 --json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from hydraulis.parallel import ParallelConfig, Replica
from hydraulis.runtime import StageModel, build_replica_groups, concatenate_documents, count_targets, train_step
from hydraulis.runtime.optimizer.layout import reset_parameters
from hydraulis.runtime.parallelism.launch import spawn
from hydraulis.specs import get_model


def make_micro_batches(vocab: int, micro_batches: int, tokens: int, seed: int) -> list[list[torch.Tensor]]:
    """Documents of 16..tokens/2 tokens, packed greedily so each micro-batch holds about `tokens`."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(micro_batches):
        docs, left = [], tokens
        while left >= 16:
            n = int(torch.randint(16, max(17, min(left, tokens // 2) + 1), (1,), generator=g))
            docs.append(torch.randint(0, vocab, (n,), generator=g))
            left -= n
        batches.append(docs)
    return batches


def worker(args: argparse.Namespace, config: ParallelConfig, sp: bool) -> dict:
    """One rank (started by the runtime's launcher, which sets RANK, WORLD_SIZE and MASTER_PORT)."""
    torch.set_num_threads(args.threads)
    world = config.num_gpus
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    spec = get_model(args.model)
    groups = build_replica_groups([Replica(config, tuple(range(world)))], sequence_parallel=sp)
    model = StageModel(spec, groups.tp, groups.stage, config.pp)
    reset_parameters(model, 0)
    docs = make_micro_batches(spec.vocab, args.micro_batches, args.tokens, seed=1)
    packed = [concatenate_documents(mb, pad_to_multiple=config.tp) for mb in docs]
    total_targets = count_targets([len(d) for mb in docs for d in mb])
    times = []
    for step in range(args.warmup + args.steps):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        train_step(model, groups, packed, total_targets)
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return {"tokens": sum(len(d) for mb in docs for d in mb), "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--configs", default="tp1pp1,tp2pp1,tp2pp1-sp,tp1pp2,tp2pp2,tp2pp2-sp")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per micro-batch (about)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    rows = []
    for name in args.configs.split(","):
        sp = name.endswith("-sp")
        config = ParallelConfig.parse(name.removesuffix("-sp"))
        result = spawn(worker, config.num_gpus, args, config, sp)[0]
        step_s = statistics.median(result["times"])
        rows.append(
            {
                "config": name,
                "processes": config.num_gpus,
                "tokens_per_step": result["tokens"],
                "step_s": round(step_s, 4),
                "tokens_per_s": round(result["tokens"] / step_s, 1),
            }
        )
        if not args.json:
            r = rows[-1]
            print(f"{r['config']:>10}  {r['processes']} proc  {r['tokens_per_step']:>6} tok/step  "
                  f"{r['step_s']:.3f} s/step  {r['tokens_per_s']:>9.1f} tok/s", flush=True)  # fmt: skip
    if args.json:
        json.dump({"model": args.model, "cpu_count": os.cpu_count(), "results": rows}, sys.stdout, indent=2)
        print()


if __name__ == "__main__":
    main()
