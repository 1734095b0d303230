"""The tensor collectives TP and CP run, made so that every buffer is freed on the training thread.

Gloo runs a collective on a worker thread whose work object holds the
tensors it was given, and drops it a moment after `wait` returns. Were the
training thread done with a tensor by then, its last reference, and so its
free, would be on the worker: torch's profiler, which the CPU memory meter
reads (runtime/metering/memory_meter.py), records a thread's allocations and
frees only where it was enabled, so the meter would count the tensor as held
for the rest of the step (up to 1.9 MiB of tiny's 5-10 MiB peaks). So on
CPU each collective gets aliases of its tensors (new tensors over the same
storage, whose references count on the storage) and returns once the worker
has let go of them, microseconds later. Gloo's reduce-scatter is an
all-reduce of a clone that it makes and frees itself; it is made here
instead, so that its free is seen too. On CUDA the allocator's counters see
every thread, and the collectives run as they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

RELEASE_WAIT_S = 0.05  # the longest to wait for a worker to drop its references; then the meter may over-count

# torch 2.13 renames the tensor collectives; 2.11 has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def storage_uses(tensor: torch.Tensor) -> int:
    """References to `tensor`'s storage, one of them the storage object this call makes."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


ALONE = 2  # storage_uses of a tensor that alone holds its storage: its own reference and the call's


late_waits = 0  # waits that reached the deadline in this process: a reference counted that never goes (tests: 0)


def wait_released(held: list[tuple[torch.Tensor, int]]) -> bool:
    """Wait until each tensor's storage has at most its count of references (`storage_uses`), or the deadline;
    whether they all got there."""
    global late_waits
    deadline = time.perf_counter() + RELEASE_WAIT_S
    for tensor, uses in held:
        while tensor.device.type == "cpu" and storage_uses(tensor) > uses:
            if time.perf_counter() > deadline:
                late_waits += 1
                return False
            time.sleep(0)
    return True


def wait_alone(tensors: Iterable[torch.Tensor]) -> bool:
    """Wait until each tensor is the only one holding its storage (`wait_released`): a buffer about to be dropped."""
    return wait_released([(t, ALONE) for t in tensors])


def _here(collective: Callable[..., object], *tensors: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """`collective(*tensors, group=group)`, synchronous; on CPU it returns once the backend holds none of them."""
    if tensors[0].device.type != "cpu":
        collective(*tensors, group=group)
        return
    held = [(t, storage_uses(t)) for t in tensors]
    collective(*(t.detach() for t in tensors), group=group)
    wait_released(held)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum over the group, in place into `x` (contiguous)."""
    _here(dist.all_reduce, x, group=group)
    return x


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's `x` along dim 0 of `out`, in group-rank order."""
    _here(_all_gather_single, out, x.contiguous(), group=group)
    return out


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's dim-0 block (by group rank) of the sum over the group of `x`."""
    if x.device.type != "cpu":
        _reduce_scatter_single(out, x.contiguous(), group=group)
        return out
    total = all_reduce(x.clone(memory_format=torch.contiguous_format), group)
    out.copy_(total.chunk(dist.get_world_size(group))[dist.get_rank(group)])
    return out
