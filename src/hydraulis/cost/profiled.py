"""Cost model from measured coefficients: a `hydraulis.profile/1` file."""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import Any

from hydraulis.cost.conditions import SharedCores
from hydraulis.cost.memory import MemoryModel
from hydraulis.cost.model import (
    Coefficients,
    Collectives,
    CostModel,
    Link,
    OptimizerStep,
)
from hydraulis.cost.policies import MemoryPolicy
from hydraulis.errors import HydraulisError
from hydraulis.files import Fields, load_json
from hydraulis.limits import MAX_GPUS, MAX_LAYERS, MAX_LENGTH, MAX_MODEL_DIM
from hydraulis.parallel import ParallelConfig
from hydraulis.specs import DEVICES, DTYPE_BYTES, DeviceSpec, ModelSpec

PROFILE_SCHEMA = "hydraulis.profile/1"

# Preset name -> file shipped in hydraulis/cost/profiles/.
PRESETS = {
    "llama-7b@a800-80g": "llama-7b-a800.json",
    "llama-13b@a800-80g": "llama-13b-a800.json",
    "llama-32b@a800-80g": "llama-32b-a800.json",
    # `hydraulis profile --model tiny --configs tp1pp1,tp2pp1,tp1pp2,tp2pp2,tp4pp1,tp1pp4 --nproc 4` on CPU.
    "tiny@cpu-measured": "tiny-cpu-measured.json",
}


class ProfiledCostModel(CostModel):
    """Coefficients per config as measured (times in the file are milliseconds)."""

    @classmethod
    def from_file(cls, path: str | Path) -> ProfiledCostModel:
        return cls.from_dict(load_json(path, PROFILE_SCHEMA), str(path))

    @classmethod
    def preset(cls, name: str) -> ProfiledCostModel:
        if name not in PRESETS:
            raise HydraulisError(f"unknown profile preset {name!r}; presets: {', '.join(PRESETS)}")
        path = resources.files("hydraulis.cost") / "profiles" / PRESETS[name]
        with resources.as_file(path) as p:
            return cls.from_file(p)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "profile") -> ProfiledCostModel:
        f = Fields(data, where)
        m = f.obj("model")
        model = ModelSpec(
            name=m.str("name"),
            layers=m.int("layers", minimum=1, maximum=MAX_LAYERS),
            hidden=m.int("hidden", minimum=1, maximum=MAX_MODEL_DIM),
            ffn=m.int("ffn", minimum=1, maximum=MAX_MODEL_DIM),
            heads=m.int("heads", minimum=1, maximum=MAX_MODEL_DIM),
            kv_heads=m.int("kv_heads", default=m.int("heads", minimum=1), minimum=1, maximum=MAX_MODEL_DIM),
            vocab=m.int("vocab", minimum=1, maximum=MAX_MODEL_DIM),
        )
        d = f.obj("device")
        device_name = d.str("name")
        memory_bytes = d.int("memory_bytes", minimum=1, maximum=2**50)
        gpus_per_node = d.int("gpus_per_node", default=8, minimum=1, maximum=MAX_GPUS)
        base = DEVICES.get(device_name)
        if base is None:
            # Unknown hardware: bandwidths only matter for p2p and gradient sync.
            base = DeviceSpec(device_name, memory_bytes, peak_flops=0.0, intra_node_bw=200e9, inter_node_bw=25e9)
        device = dataclasses.replace(base, memory_bytes=memory_bytes, gpus_per_node=gpus_per_node)

        coefficients: dict[ParallelConfig, Coefficients] = {}
        busy_ranks: dict[ParallelConfig, int] = {}
        for i, row in enumerate(f.list("time_ms")):
            r = Fields(row, f"{where}.time_ms[{i}]")
            config = ParallelConfig.from_fields(r)
            if config in coefficients:
                raise HydraulisError(f"{where}.time_ms[{i}]: {config.name} appears twice")
            coefficients[config] = Coefficients(
                r.float("a", minimum=0) / 1e3, r.float("b", minimum=0) / 1e3, r.float("c", minimum=0) / 1e3
            )
            if "busy_ranks" in row:
                busy_ranks[config] = r.int("busy_ranks", minimum=1, maximum=MAX_GPUS)
        if not coefficients:
            raise HydraulisError(f"{where}.time_ms: no configs")

        memory = _memory(f, memory_bytes, _dtype_bytes(d))
        min_eff = {}
        if "min_efficient_tokens" in data:
            me = f.obj("min_efficient_tokens")
            for key in me.data:
                try:
                    min_eff[int(key)] = me.int(key, minimum=0, maximum=MAX_LENGTH)
                except ValueError:
                    raise HydraulisError(f"{me.where}: key {key!r} is not a TP degree") from None
        for config in coefficients:
            config.validate(model)
        collectives = _collectives(f) if "collectives" in data else None
        shared = None
        if "shared_cores" in data:
            sc = f.obj("shared_cores")
            shared = SharedCores(
                sc.int("cores", minimum=1, maximum=MAX_GPUS), sc.int("threads_per_rank", minimum=1, maximum=MAX_GPUS),
                busy_ranks,
            )
        step = _optimizer_step(f) if "optimizer_step" in data else None
        cost = cls(
            f.str("name"), model, device, coefficients=coefficients, memory=memory, min_efficient_tokens=min_eff,
            collectives=collectives, shared_cores=shared, optimizer_step=step,
        )
        cost.profile_data = data
        table = f.obj("policy_time") if "policy_time" in data else None  # measured memory policies' factors
        for name in table.data if table is not None else ():
            factors = table.obj(name)
            cost.policy_scales[ParallelConfig.parse(name)] = {
                MemoryPolicy.parse(p, factors.where): (factors.float(p, minimum=1.0),) * 2 for p in factors.data}
        return cost


def _memory(f: Fields, memory_bytes: int, activation_dtype_bytes: int) -> MemoryModel:
    """The profile's memory model (`memory`): activation factors per TP degree, state, margins."""
    mem = f.obj("memory")
    act = mem.obj("activation_bytes_per_token_hidden_layer")
    activation = {}
    for key in act.data:
        try:
            tp = int(key)
        except ValueError:
            raise HydraulisError(f"{act.where}: key {key!r} is not a TP degree") from None
        activation[tp] = act.float(key, minimum=0)
        if activation[tp] <= 0:  # the cap divides by it
            raise HydraulisError(f"{act.where}.{key}: must be positive, got {activation[tp]}")
    if not activation:
        raise HydraulisError(f"{act.where}: empty")
    if "method" in mem.data:  # measured by this runtime (`hydraulis profile`): the memory model counts its own
        activation = {}
    memory = MemoryModel(
        memory_bytes=memory_bytes,
        activation_bytes_per_token_hidden_layer=activation,
        state_bytes_per_hidden2_layer=mem.float("state_bytes_per_hidden2_layer", minimum=0),
        optimizer_sharded_fraction=mem.float("optimizer_sharded_fraction", minimum=0),
        context_overhead_bytes=mem.float("context_overhead_bytes", minimum=0),
        safety_margin_bytes=mem.float("safety_margin_bytes", minimum=0),
        embedding_state_bytes=mem.float("embedding_state_bytes", default=16.0, minimum=0),
        # A measured profile's activation factors are in the dtype it ran (fp32 on CPU); published ones in bf16.
        activation_dtype_bytes=activation_dtype_bytes,
    )
    if memory.optimizer_sharded_fraction > 1:
        raise HydraulisError(f"{mem.where}.optimizer_sharded_fraction: must be at most 1")
    return memory


def _dtype_bytes(device: Fields) -> int:
    """Bytes per element of the profile's own dtype (`device.dtype`), bf16 when it names none."""
    name = device.str("dtype", default="bf16")
    if name not in DTYPE_BYTES:
        raise HydraulisError(f"{device.where}.dtype: {name!r} is not a compute dtype; one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def _collectives(f: Fields) -> Collectives:
    """The optional measured links of `hydraulis profile` (a profile without them uses the device constants)."""
    c = f.obj("collectives")
    links: dict[str, Link | None] = {}
    for key in ("all_to_all", "p2p"):
        if key not in c.data:
            links[key] = None
            continue
        link = c.obj(key)
        bandwidth = link.float("bandwidth_Bps", minimum=0)
        if bandwidth <= 0:
            raise HydraulisError(f"{link.where}.bandwidth_Bps: must be positive, got {bandwidth}")
        links[key] = Link(link.float("latency_s", minimum=0), bandwidth)
    return Collectives(c.int("world_size", minimum=1), links["all_to_all"], links["p2p"])


def _optimizer_step(f: Fields) -> OptimizerStep:
    """The optional measured optimizer phase of `hydraulis profile`: milliseconds per config name (the whole
    phase, and where measured its gather and reduce alone)."""
    o = f.obj("optimizer_step")
    tables: dict[str, dict[ParallelConfig, float]] = {}
    for part in ("ms", "gather_ms", "reduce_ms"):
        if part == "ms" or part in o.data:
            ms = o.obj(part)
            tables[part] = {}
            for key in ms.data:
                try:
                    config = ParallelConfig.parse(key)
                except HydraulisError:
                    raise HydraulisError(f"{ms.where}: key {key!r} is not a parallel config") from None
                tables[part][config] = ms.float(key, minimum=0) / 1e3
    world = o.int("world_size", minimum=1, maximum=MAX_GPUS)
    return OptimizerStep(world, tables["ms"], tables.get("gather_ms", {}), tables.get("reduce_ms", {}))
