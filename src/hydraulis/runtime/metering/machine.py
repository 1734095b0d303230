"""What this machine offers a run (`hydraulis check`): torch and its CUDA, the collective backends, the devices
and their memory, the attention kernel each dtype takes, the device's peak, and the cached profiles that match.

The figures are read, not assumed: the backends are asked (`dist.is_*_available`) and then used (an all-reduce
on the job's own group and on a gloo group beside it), the kernels are the ones `varlen_attention` and
`chunk_attention` would pick (attention.py, blockwise_attention.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from hydraulis.cost import profile_cache
from hydraulis.cost.conditions import cpu_cores
from hydraulis.errors import HydraulisError
from hydraulis.runtime.metering.profiler import describe_device
from hydraulis.runtime.modeling.attention import attention_backend
from hydraulis.runtime.modeling.blockwise_attention import block_kernel
from hydraulis.runtime.parallelism.launch import DTYPES
from hydraulis.specs import DEVICES, DeviceSpec

GPU_PRESETS = ("h200", "h100", "a800", "a100")  # the GPU device presets (specs.DEVICES), by the name they go by


def check_device(kind: str) -> torch.device:
    """The device the check runs on: cuda is the current GPU (LOCAL_RANK's under torchrun), cpu the host."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise HydraulisError(
                f"--device cuda: torch {torch.__version__} sees no CUDA device; run it on a GPU, or pass --device cpu"
            )
        index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def environment(device: torch.device) -> dict[str, Any]:
    """torch, its CUDA and the backends it was built with; every device and its memory."""
    cuda = torch.cuda.is_available()
    nccl = dist.is_available() and dist.is_nccl_available()
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,  # None for a CPU build of torch
        "cuda_available": cuda,
        "nccl": {"available": nccl, "version": _nccl_version() if nccl and cuda else None},
        "gloo": {"available": dist.is_available() and dist.is_gloo_available()},
        "cpu_cores": cpu_cores(),
        "host_memory_bytes": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
        "devices": [],
        "device": str(device),
    }
    for i in range(torch.cuda.device_count() if cuda else 0):
        props = torch.cuda.get_device_properties(i)
        env["devices"].append({"index": i, "name": props.name, "memory_bytes": int(props.total_memory),
                               "capability": f"{props.major}.{props.minor}",
                               "multiprocessors": props.multi_processor_count})  # fmt: skip
    return env


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def collectives(device: torch.device) -> dict[str, Any]:
    """An all-reduce on the job's group (NCCL on a GPU, gloo on CPU) and on a gloo group beside it: both work."""
    out = {}
    groups = {dist.get_backend(): (None, device)}
    if dist.get_backend() != "gloo":
        groups["gloo"] = (dist.new_group(backend="gloo"), torch.device("cpu"))
    for backend, (group, where) in groups.items():
        x = torch.full((4,), float(dist.get_rank() + 1), device=where)
        try:
            dist.all_reduce(x, group=group)
            if where.type == "cuda":
                torch.cuda.synchronize(where)
            world = dist.get_world_size(group)
            want = world * (world + 1) / 2
            out[backend] = {"works": bool(torch.all(x.cpu() == want)), "world_size": world}
        except (RuntimeError, dist.DistError) as exc:
            said = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            out[backend] = {"works": False, "error": said}
    return out


def kernels(device: torch.device, head_dim: int) -> dict[str, dict[str, str]]:
    """The attention path each compute dtype takes here: varlen (packed documents) and CP (a chunk's blocks)."""
    dtypes = dict(DTYPES, **({"fp16": torch.float16} if device.type == "cuda" else {}))
    return {name: {"varlen": attention_backend(device, dtype, head_dim),
                   "cp": block_kernel(device, dtype, head_dim).name}
            for name, dtype in dtypes.items()}  # fmt: skip


def device_spec(device: torch.device) -> tuple[DeviceSpec, float | None, str]:
    """This device as the cost model takes it, its dense bf16 peak FLOP/s (None: unknown) and where the peak is from.

    A GPU of a preset (H100, H200, A100, A800) is that preset with its own memory; another GPU takes the H100's
    figures for planning and has no peak; a CPU's peak is the `cpu` preset's estimate.
    """
    if device.type != "cuda":
        return DEVICES["cpu"], DEVICES["cpu"].peak_flops, "the cpu preset's estimate, not measured"
    props = torch.cuda.get_device_properties(device)
    preset = next((p for p in GPU_PRESETS if p in props.name.lower()), None)
    base = next(d for n, d in DEVICES.items() if n.startswith(preset or "h100"))
    spec = dataclasses.replace(base, memory_bytes=int(props.total_memory))
    if preset is None:
        return spec, None, f"unknown for {props.name} (no device preset names it)"
    return spec, base.peak_flops, f"{base.name}'s dense bf16 peak (datasheet)"


def profiles(device: torch.device, dtype: str) -> list[dict[str, Any]]:
    """The shared cache's profiles measured on a machine like this one (cost/profile_cache.py)."""
    described = describe_device(device.type, 1, dtype, torch.get_num_threads())
    memory = described["memory_bytes"] if device.type == "cuda" else None
    return profile_cache.matching(described["name"], cpu_cores(), memory)
