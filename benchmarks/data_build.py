"""`hydraulis data build` against the tokenizer alone, on the same texts, in the same run.

The tokenizer alone is GPT-2 through tiktoken in this process, one thread, no files: `encode_ordinary` (what
issue 53 measured: 8.3 MB/s) and `encode_to_numpy` (the call the build makes; the same ids). The build is the
real command in a child (`--workers 1`, then every core), its time the child's wall clock, process start,
imports and the tokenizer's setup included, and its CPU time the child's and its workers' (getrusage).
Each repeat runs them one after another, so a load on the machine touches all of them alike; the figures
are medians over the repeats, with their spread (min-max). On a shared machine the wall clock measures the
load too, so each build also gets the time it would take on idle cores, from its processes' CPU seconds:
the serial start, then max(the busiest worker, the rest / the workers) (a lower bound: it assumes a
perfect share of the cores).

Targets (issue 53): one worker at least 0.75x the tokenizer alone, all cores of a 2-core machine at least
1.7x one worker. The corpus: a jsonl of `{"text": ...}` records, e.g. the Python standard library's sources
repeated and shuffled to 200 MB (`--make 200` writes it, from this interpreter's own sources).

Run: .venv/bin/python benchmarks/data_build.py CORPUS.jsonl [--make MB] [--repeats 3] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from hydraulis.data.tokenizer import get_tokenizer


def make_corpus(path: Path, megabytes: float) -> None:
    """The standard library's .py sources as {"text": ...} lines, shuffled and repeated to `megabytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for p in sorted(root.rglob("*.py")):
        if "site-packages" not in p.parts and p.is_file():
            try:
                texts.append(p.read_text("utf-8"))
            except (OSError, UnicodeDecodeError):
                continue
    rng, written = random.Random(0), 0
    with path.open("w", encoding="utf-8") as fh:
        while written < megabytes * 1e6:
            rng.shuffle(texts)
            for text in texts:
                line = json.dumps({"text": text}) + "\n"
                fh.write(line)
                written += len(line)
                if written >= megabytes * 1e6:
                    break


def tokenizer_alone(texts: list[str], call: str) -> tuple[float, float, int]:
    """Wall and CPU seconds of the tokenizer over the texts, and the tokens."""
    enc = get_tokenizer("gpt2").encoding
    if call == "encode_ordinary":
        def fn(t: str) -> int:
            return len(enc.encode_ordinary(t))
    else:
        def fn(t: str) -> int:
            return len(enc.encode_to_numpy(t, disallowed_special=()))
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = sum(fn(t) for t in texts)
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


def build(corpus: Path, out: Path, workers: int) -> tuple[float, float, float]:
    """Wall and CPU seconds (the command's and its workers') of `hydraulis data build`, and the seconds it
    would take on `workers` idle cores: the command's CPU before its first worker started, then the larger of
    the busiest worker's CPU and the rest of all CPU / workers (read from /proc every 50 ms, the last reading
    before each process ends)."""
    shutil.rmtree(out, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "hydraulis.cli", "data", "build", str(corpus), "--out", str(out),
           "--workers", str(workers)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: dict[int, float] = {}
    serial = None  # the command's CPU before its first worker started (imports, the tokenizer, the first chunk)
    while proc.poll() is None:
        children = _children(proc.pid)
        for pid in [proc.pid, *children]:
            if (used := _cpu(pid)) is not None:
                seen[pid] = used
        if children and serial is None:
            serial = seen.get(proc.pid, 0.0)
        time.sleep(0.05)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"data build failed: {proc.stderr.read() if proc.stderr else ''}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if serial is None:  # one process: all of it serial
        return wall, cpu, cpu
    rest = sum(seen.values()) - serial
    return wall, cpu, serial + max(max(v for pid, v in seen.items() if pid != proc.pid), rest / workers)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _cpu(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (/proc/PID/stat), None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--make", type=float, default=None, help="write the corpus first, this many MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="all cores: default")
    args = parser.parse_args()
    if args.make is not None:
        make_corpus(args.corpus, args.make)
    size = args.corpus.stat().st_size
    with args.corpus.open("rb") as fh:
        texts = [json.loads(line)["text"] for line in fh]
    runs: dict[str, list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="data-build-bench-", dir=args.corpus.parent) as folder:
        for r in range(args.repeats):
            for call in ("encode_ordinary", "encode_to_numpy"):
                wall, cpu, tokens = tokenizer_alone(texts, call)
                runs.setdefault(f"tokenizer {call}", []).append((wall, cpu, cpu))
            for workers in sorted({1, args.workers}):
                timed = build(args.corpus, Path(folder) / "c", workers)
                runs.setdefault(f"build {workers} worker(s)", []).append(timed)
            print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    report(runs, size, tokens, args.workers)


def report(runs: dict[str, list[tuple[float, float, float]]], size: int, tokens: int, workers: int) -> None:
    mb = size / 1e6
    print(f"corpus {mb:.0f} MB, {tokens:,} GPT-2 tokens; {len(next(iter(runs.values())))} repeats, medians "
          f"(min-max); the machine's load: {os.getloadavg()[0]:.1f}")  # fmt: skip
    rate = {}
    for name, triples in runs.items():
        wall, cpu, idle = (np.array(column) for column in zip(*triples, strict=True))
        rate[name] = (mb / np.median(wall), mb / np.median(cpu), mb / np.median(idle))
        print(f"{name:28s} wall {np.median(wall):6.1f} s ({wall.min():.1f}-{wall.max():.1f}): "
              f"{mb / np.median(wall):5.1f} MB/s;  CPU {np.median(cpu):6.1f} s: {mb / np.median(cpu):5.1f} MB per "
              f"CPU-s; on idle cores {np.median(idle):6.1f} s")  # fmt: skip
    one, alone = rate["build 1 worker(s)"], rate["tokenizer encode_ordinary"]
    print(f"1 worker / encode_ordinary alone: {one[0] / alone[0]:.2f}x wall, {one[1] / alone[1]:.2f}x per CPU-s "
          f"(target >= 0.75x); / encode_to_numpy alone: {one[0] / rate['tokenizer encode_to_numpy'][0]:.2f}x wall, "
          f"{one[1] / rate['tokenizer encode_to_numpy'][1]:.2f}x per CPU-s")  # fmt: skip
    if workers > 1:
        many = rate[f"build {workers} worker(s)"]
        quickest = {name: min(w for w, _, _ in triples) for name, triples in runs.items()}
        fastest = quickest["build 1 worker(s)"] / quickest[f"build {workers} worker(s)"]
        print(f"{workers} workers / 1 worker: {many[0] / one[0]:.2f}x wall (the fastest of each: {fastest:.2f}x; "
              f"target >= 1.7x on 2 cores); "
              f"{many[2] / one[2]:.2f}x on idle cores (from each process's CPU); CPU per MB {one[1] / many[1]:.2f}x "
              "of one worker's (1.0: no work added by the split)")  # fmt: skip


if __name__ == "__main__":
    main()
