"""Which collective for a homogeneous deployment's exchange: all-to-all against all-gather and reduce-scatter.

In `4x(tp1,pp1)` on 4 ranks every rank computes the whole model and owns a quarter of it. For one
message of S bytes of fp32 (a bucket of the model; S = 1, 4, 16, 64 MiB), each rank owning S/4:

- gather, each owner's window to all 4 ranks: `all_to_all_single` with equal splits, the owner's
  window repeated once per rank in the send buffer (what Hydraulis's exchange rounds do for this
  deployment: S in, S out), against `all_gather_into_tensor` (S/4 in, S out);
- reduce, every rank's gradient summed into its owner's window: `all_to_all_single` with equal
  splits (S in, S out: 4 copies of the own window) followed by the owner's sum, against
  `reduce_scatter_tensor` (S in, S/4 out, summed inside the collective).

Bytes moved per rank are the same by construction: each rank sends and receives 3/4 S off-rank
either way (the all-to-all's piece for itself is a local copy). What differs is the algorithm the
backend runs, its copies, and for the reduce where the sum happens. One exception, gloo's: its
`reduce_scatter_tensor` clones the input, all-reduces the whole of it and copies out the own chunk
(ProcessGroupGloo::reduce_scatter_tensor_coalesced in torch's source), so on gloo it moves an
all-reduce's bytes, 2 x 3/4 S, twice the minimum; NCCL's reduce-scatter moves the minimum. The
gather ratio is the like-for-like one here; the reduce ratio measures gloo's choice as much as ours.

Measurement: 4 gloo ranks, one process each. Per size, one untimed round of the four operations
(which also checks that both gathers give the same tensor and both reduces the same sums), then
`--reps` repetitions, interleaved: every repetition runs all four, each after a barrier. The time of
an operation is the slowest rank's. Printed: the median per operation and the ratios all-to-all /
collective (above 1: the collective is faster). CPU figures: the ranks share this machine's cores.

    .venv/bin/python benchmarks/exchange_collectives.py [--sizes 1,4,16,64] [--reps 9] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

WORLD = 4
MiB = 2**20
OPS = ("a2a_gather", "all_gather", "a2a_reduce", "reduce_scatter")


def _operations(size_bytes: int, rank: int) -> dict:
    """The four operations on one message; each returns its result (gathered tensor, or owned sums)."""
    import torch
    import torch.distributed as dist
    from peer_models import all_gather_single, reduce_scatter_single

    n = size_bytes // 4 // WORLD * WORLD  # fp32 elements, divisible by the ranks
    w = n // WORLD
    g = torch.Generator().manual_seed(rank)
    owned = torch.randn(w, generator=g)  # this rank's window of the parameters
    grad = torch.randn(n, generator=g)  # this rank's full gradient
    send, recv, out, rs_out = torch.empty(n), torch.empty(n), torch.empty(n), torch.empty(w)

    def a2a_gather():
        send.view(WORLD, w).copy_(owned)  # the window once per rank
        dist.all_to_all_single(recv, send)
        return recv

    def all_gather():
        all_gather_single(out, owned)
        return out

    def a2a_reduce():
        dist.all_to_all_single(recv, grad)
        return recv.view(WORLD, w).sum(0)

    def reduce_scatter():
        reduce_scatter_single(rs_out, grad)
        return rs_out

    return {"a2a_gather": a2a_gather, "all_gather": all_gather, "a2a_reduce": a2a_reduce,
            "reduce_scatter": reduce_scatter}


def worker(sizes_mib: list[int], reps: int) -> dict:
    import torch
    import torch.distributed as dist

    from hydraulis.runtime.parallelism.launch import init_distributed

    env = init_distributed("cpu")
    result = {}
    for mib in sizes_mib:
        ops = _operations(mib * MiB, env.rank)
        first = {name: op().clone() for name, op in ops.items()}  # warm-up and the check
        agree = {"gather": bool(torch.equal(first["a2a_gather"], first["all_gather"])),
                 "reduce": bool(torch.allclose(first["a2a_reduce"], first["reduce_scatter"], rtol=1e-5, atol=1e-5))}
        seconds = {name: [] for name in OPS}
        for _ in range(reps):
            for name in OPS:
                dist.barrier()
                start = time.perf_counter()
                ops[name]()
                seconds[name].append(time.perf_counter() - start)
        t = torch.tensor([seconds[name] for name in OPS], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time per operation and repetition
        result[mib] = {"seconds": dict(zip(OPS, t.tolist(), strict=True)), "agree": agree}
        del ops, first
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16,64", help="message sizes in MiB of fp32, comma-separated")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions per size")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes {args.sizes!r}: give whole MiB, comma-separated, e.g. 1,4,16,64")
    if args.reps < 1 or any(s < 1 for s in sizes):
        parser.error("--reps and every size must be at least 1")
    from hydraulis.runtime.parallelism.launch import spawn

    print(f"{WORLD} gloo ranks, fp32, {args.reps} interleaved repetitions per size; the slowest rank's time, "
          "median (CPU: informative)", flush=True)
    ranks = spawn(worker, WORLD, sizes, args.reps)
    rows = {}
    print(f"  {'MiB':>4} {'a2a gather':>11} {'all-gather':>11} {'ratio':>6}   {'a2a+sum':>9} {'red-scatter':>11}"
          f" {'ratio':>6}   {'sent MiB/rank':>13}")
    for mib in sizes:
        r = ranks[0][mib]
        med = {name: statistics.median(r["seconds"][name]) for name in OPS}
        if not all(r["agree"].values()):
            raise SystemExit(f"{mib} MiB: the two ways disagree ({r['agree']}): a bug, not a measurement")
        rows[mib] = {"median_s": med, "gather_ratio": med["a2a_gather"] / med["all_gather"],
                     "reduce_ratio": med["a2a_reduce"] / med["reduce_scatter"],
                     "sent_mib_per_rank": mib * (WORLD - 1) / WORLD, "seconds": r["seconds"]}
        x = rows[mib]
        print(f"  {mib:>4} {med['a2a_gather']:>10.4f}s {med['all_gather']:>10.4f}s {x['gather_ratio']:>6.2f}"
              f"   {med['a2a_reduce']:>8.4f}s {med['reduce_scatter']:>10.4f}s {x['reduce_ratio']:>6.2f}"
              f"   {x['sent_mib_per_rank']:>13.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"world": WORLD, "reps": args.reps, "sizes": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
