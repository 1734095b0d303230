"""Peak memory as torch's allocator reports it, independent of the memory model's formulas.

On CUDA: `torch.cuda.max_memory_allocated` around the measured block. On CPU
torch keeps no allocator statistics, so the block runs under torch's
profiler with memory profiling, which records every allocation and free of
the CPU allocator; the running sum of those events gives the peak above
what was allocated at entry. Neither reads a byte count from the model.

Memory profiling makes torch's CPU allocator log a warning on stderr when a
block allocated before the window is freed inside it (every step frees the
last one's tensors): `_AllocatorNotice` takes exactly that line out of the
window's stderr and passes every other one on.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
from types import TracebackType

import torch
from torch._C import _autograd
from torch._C._profiler import _ExperimentalConfig
from torch.autograd.profiler import ProfilerConfig, ProfilerState

MEMORY_EVENT = "memory_alloc"
WINDOW_PREFIX = "hydraulis."  # record_function ranges whose own peaks a PeakMeter keeps


class PeakMeter:
    """`with PeakMeter(device) as m: ...`; then `m.peak_bytes` is the most bytes allocated above entry.

    On CPU, `m.window_peak(name)` is the most bytes allocated above the start of any
    `torch.autograd.profiler.record_function(name)` range inside the block (on CUDA it is 0:
    use a meter of its own there).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.peak_bytes = 0
        self._base = 0
        self._windows: dict[str, int] = {}
        self._active = False
        self._notice: _AllocatorNotice | None = None

    def __enter__(self) -> PeakMeter:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> PeakMeter:
        self._windows = {}
        self._active = not (self.device.type == "cpu" and _autograd._profiler_enabled())
        if not self._active:  # someone else is profiling this process: measure nothing rather than break it
            self.peak_bytes = 0
            return self
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            # The legacy (non-Kineto) profiler: it records the CPU allocator's events as Kineto does,
            # without Kineto's start/stop lines on stderr and its second of start-up.
            config = ProfilerConfig(
                ProfilerState.CPU, report_input_shapes=False, profile_memory=True, with_stack=False, with_flops=False,
                with_modules=False, experimental_config=_ExperimentalConfig(),
            )
            self._notice = _AllocatorNotice.start()
            _autograd._enable_profiler_legacy(config)
        return self

    def abandon(self) -> None:
        """Stop without a figure (the step raised): the profiler off and stderr back where it was."""
        if self._active and self.device.type == "cpu" and _autograd._profiler_enabled():
            with contextlib.suppress(Exception):
                _autograd._disable_profiler_legacy()
        if self._notice is not None:
            self._notice.stop()
            self._notice = None
        self._active = False

    def stop(self) -> None:
        if not self._active:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
            return
        threads = _autograd._disable_profiler_legacy()
        if self._notice is not None:
            self._notice.stop()
            self._notice = None
        # Each thread's events are in order; a stable sort by time merges the threads and keeps that order.
        events = sorted(
            ((e.start_us(), e.kind(), e.name(), e.cpu_memory_usage(), i) for i, t in enumerate(threads) for e in t),
            key=lambda e: e[0],
        )
        current = peak = 0
        stacks: dict[int, list[str]] = {}
        open_at: dict[str, list[int]] = {}  # record_function name -> [bytes at its start, peak inside]
        for _, what, name, change, thread in events:
            if what == "push":
                stacks.setdefault(thread, []).append(name)
                if name.startswith(WINDOW_PREFIX):
                    open_at[name] = [current, current]
            elif what == "pop" and stacks.get(thread):
                name = stacks[thread].pop()
                if name in open_at:
                    start, top = open_at.pop(name)
                    self._windows[name] = max(self._windows.get(name, 0), top - start)
            elif what == MEMORY_EVENT:
                current += change
                peak = max(peak, current)
                for window in open_at.values():
                    window[1] = max(window[1], current)
        self.peak_bytes = peak

    def window_peak(self, name: str) -> int:
        return self._windows.get(name, 0)


class _AllocatorNotice:
    """stderr (fd 2) into a file while the CPU memory profiler runs; then every line but the allocator's
    "Memory block of unknown size was allocated before the profiling started" goes on to stderr.

    That line says the profiler cannot see the freeing of a block it did not see allocated, which is the
    meter's design (it measures the peak above the window's start), so nobody can act on it; torch logs it
    for one such block in 1000 (a log counter), on every rank. torch has no switch for it alone."""

    SAID = (b"CPUAllocator.cpp", b"Memory block of unknown size")

    def __init__(self, file: tempfile.TemporaryFile, saved: int) -> None:  # type: ignore[valid-type]
        self.file = file
        self.saved = saved

    @classmethod
    def start(cls) -> _AllocatorNotice | None:
        """None where stderr is no file descriptor to borrow (then the line shows, as it did)."""
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        try:
            saved = os.dup(2)
        except OSError:
            return None
        try:
            file = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop
            os.dup2(file.fileno(), 2)
        except OSError:
            os.close(saved)
            return None
        return cls(file, saved)

    def stop(self) -> None:
        try:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
        finally:
            os.dup2(self.saved, 2)
            os.close(self.saved)
        self.file.seek(0)
        kept = b"".join(line for line in self.file if not all(s in line for s in self.SAID))
        self.file.close()
        if kept:
            with contextlib.suppress(OSError):
                os.write(2, kept)


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
            ptr = storage.data_ptr()  # a storage FSDP2 has freed raises here
        except (RuntimeError, ReferenceError):
            continue
        if ptr:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
    return sum(seen.values())
