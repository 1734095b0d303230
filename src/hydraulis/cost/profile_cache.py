"""The shared cache of `profile = "auto"` profiles: `$HYDRAULIS_CACHE/profiles` (no torch).

A profile measured for one run serves every later run on the same machine
that asks for the same thing: the file name is a hash of the model (its
content, not its name or path), the configs, the device (kind and name),
dtype, world size, core count and sweep, so a lookup is one `stat`. It holds profiles measured quiet, and
nothing of a run's own (its online refit stays in its run directory): what a later run reads here does not
depend on how busy the machine was, or on which run came before (training/auto_profile.py).
`timings.jsonl` beside the profiles keeps
how long each profiling took beside the analytic model's compute time for
it, so the next one, of any model, states its expected time before it starts.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path
from typing import Any

from hydraulis.cost.conditions import cpu_cores
from hydraulis.data.build.staging import cache_dir
from hydraulis.errors import HydraulisError
from hydraulis.files import read_jsonl, write_json_atomic
from hydraulis.parallel import ParallelConfig

TIMINGS = "timings.jsonl"


def profiles_dir() -> Path:
    """`$HYDRAULIS_CACHE/profiles` (default ~/.cache/hydraulis/profiles)."""
    return cache_dir() / "profiles"


def machine(device: str, device_name: str) -> dict[str, Any]:
    """What makes two machines time alike: device kind and name, and the cores this process may run on."""
    return {"device": device, "device_name": device_name, "cores": cpu_cores()}


def cache_path(identity: dict[str, Any], label: str) -> Path:
    """The cache file of a profile request (its identity: model, configs, machine, dtype, world, sweep);
    `label` (the model's family) only makes the name readable."""
    return profiles_dir() / f"{label}-{digest(identity)}.json"


def digest(identity: dict[str, Any]) -> str:
    """A short hash of a JSON-able identity (a profile request, a model's content)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def store(path: Path, data: dict[str, Any]) -> None:
    """Write a measured profile into the cache (atomically: a reader sees all of it or none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data)


def record_timing(where: dict[str, Any], steps: int, wall_s: float, model: str, analytic_s: float | None) -> None:
    """One line in timings.jsonl: how long a profile of `model` (its content digest) took here, beside the
    analytic model's compute time for it, so a later profile of another model scales its own."""
    if steps <= 0 or wall_s <= 0:
        return
    profiles_dir().mkdir(parents=True, exist_ok=True)
    row = {**where, "model": model, "steps": steps, "wall_s": wall_s, "analytic_s": analytic_s}
    with open(profiles_dir() / TIMINGS, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")


def expected_s(where: dict[str, Any], steps: int, model: str, analytic_s: float | None) -> tuple[float, str] | None:
    """Seconds this profile should take here, and whence; None: no estimate.

    Why not seconds per step of earlier profiles: a step of another model costs something else (a 60 s
    estimate for 20 s). This model's analytic compute time, scaled by what earlier profiles here took
    against theirs (of this model first, if any), else this model's own earlier rate, else the analytic time.
    """
    rows = _timings(where)
    mine = [r for r in rows if r.get("model") == model]
    scaled = [r for r in mine or rows if r.get("analytic_s")]
    if analytic_s and scaled:
        ratio = statistics.median(float(r["wall_s"]) / float(r["analytic_s"]) for r in scaled)
        whose = "this model's" if mine else "other models'"
        return analytic_s * ratio, f"its analytic compute time x{ratio:.1f}, as {whose} earlier profiles here took"
    if mine:
        rate = statistics.median(float(r["wall_s"]) / float(r["steps"]) for r in mine)
        return rate * steps, "from earlier profiles of this model here"
    if analytic_s:
        return analytic_s, "compute only, by the analytic model: a first profile here"
    return None


def _timings(where: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of timings.jsonl from this machine (`where`)."""
    rows = read_jsonl(profiles_dir() / TIMINGS)
    return [r for r in rows if all(r.get(k) == v for k, v in where.items()) and r.get("steps")]


def matching(device_name: str, cores: int, memory_bytes: int | None = None) -> list[dict[str, Any]]:
    """The cached profiles measured on a machine like this one (`hydraulis check`): the same device name, on a GPU
    the same memory, on a CPU the same cores; each as its file, name, model, configs and world size."""
    found = []
    for path in sorted(profiles_dir().glob("*.json")) if profiles_dir().is_dir() else ():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            device, conditions = data.get("device") or {}, data.get("conditions") or {}
            if data.get("schema") != "hydraulis.profile/1" or device.get("name") != device_name:
                continue
            measured_on = conditions.get("cores") or (data.get("shared_cores") or {}).get("cores")
            if device_name == "cpu" and measured_on != cores:
                continue
            if device_name != "cpu" and memory_bytes is not None and device.get("memory_bytes") != memory_bytes:
                continue
            configs = sorted({ParallelConfig(r["tp"], r["pp"], r.get("cp", 1)).name for r in data.get("time_ms", [])})
            world = (data.get("measurements") or {}).get("world_size") or conditions.get("world_size")
            found.append({"file": str(path), "name": data.get("name"), "model": (data.get("model") or {}).get("name"),
                          "configs": configs, "world_size": world})  # fmt: skip
        except (OSError, ValueError, TypeError, KeyError, AttributeError, HydraulisError):
            continue  # not a profile this check can read: not one that matches
    return found
