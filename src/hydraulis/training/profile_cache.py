"""The shared cache of `profile = "auto"` profiles: `$HYDRAULIS_CACHE/profiles` (no torch).

A profile measured for one run serves every later run on the same machine
that asks for the same thing: the file name is a hash of the model (its
content, not its name or path), the configs, the device (kind and name),
dtype, world size, core count and sweep, so a lookup is one `stat`. `timings.jsonl` beside the profiles keeps
how long each profiling took per measurement step, so the next one states
its expected time before it starts.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path
from typing import Any

from hydraulis.cost.conditions import cpu_cores
from hydraulis.data.staging import cache_dir
from hydraulis.errors import HydraulisError
from hydraulis.jsonio import write_json_atomic
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
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    return profiles_dir() / f"{label}-{digest}.json"


def refit_path(path: Path) -> Path:
    """Where a run keeps its refit of the profile at `path` (cost/refit.py): beside it, marked as refit.

    A later run of the same request takes the refit one first: it was corrected by a run's measurements.
    """
    return path.with_name(f"{path.stem}.refit{path.suffix}")


def store(path: Path, data: dict[str, Any]) -> None:
    """Write a measured profile into the cache (atomically: a reader sees all of it or none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data)


def record_timing(where: dict[str, Any], steps: int, wall_s: float) -> None:
    """One line in timings.jsonl: seconds per measurement step on this machine."""
    if steps <= 0 or wall_s <= 0:
        return
    profiles_dir().mkdir(parents=True, exist_ok=True)
    with open(profiles_dir() / TIMINGS, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({**where, "steps": steps, "wall_s": wall_s}) + "\n")


def expected_s(where: dict[str, Any], steps: int) -> float | None:
    """Seconds `steps` measurement steps should take here (the median rate of earlier ones); None: no history."""
    path = profiles_dir() / TIMINGS
    if not path.is_file():
        return None
    rates = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and all(row.get(k) == v for k, v in where.items()) and row.get("steps"):
            rates.append(float(row["wall_s"]) / float(row["steps"]))
    return statistics.median(rates) * steps if rates else None


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
