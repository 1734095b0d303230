"""Peak memory as torch's allocator reports it, independent of the memory model's formulas.

On CUDA: `torch.cuda.max_memory_allocated` around the measured block. On CPU
torch keeps no allocator statistics, so the block runs under the torch
profiler with `profile_memory=True`, which records every allocation and free
of the CPU allocator; the running sum of those events gives the peak above
what was allocated at entry. Neither reads a byte count from the model.
"""

from __future__ import annotations

import gc
from types import TracebackType

import torch

MEMORY_EVENT = "[memory]"


class PeakMeter:
    """`with PeakMeter(device) as m: ...`; then `m.peak_bytes` is the most bytes allocated above entry."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.peak_bytes = 0
        self._profiler: torch.profiler.profile | None = None
        self._base = 0

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            self._profiler.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(kind, exc, tb)
        if kind is not None:
            return
        events = [e for e in profiler.profiler.kineto_results.events() if e.name() == MEMORY_EVENT]
        current = peak = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            current += e.nbytes()
            peak = max(peak, current)
        self.peak_bytes = peak


def live_tensor_bytes(device: torch.device | str = "cpu") -> int:
    """Bytes of every distinct tensor storage alive in this process on `device` (each storage once).

    A census of what the process holds between steps, read from the tensors
    themselves; with a `PeakMeter` over a step it gives the step's peak.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), torch.Tensor) or obj.device.type != device.type or obj.is_meta:
                continue
            storage = obj.untyped_storage()
        except (RuntimeError, ReferenceError):
            continue
        ptr = storage.data_ptr()
        if ptr:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
    return sum(seen.values())
