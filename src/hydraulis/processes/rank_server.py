"""The fork server that local ranks are forked from (runtime/parallelism/launch.py's `spawn`).

It imports torch and the launcher once, before any thread or CUDA context
exists, and forks every rank from there: a spawned rank imported them again
(about 2 s of CPU each). The first `spawn` starts it; `hydraulis train`
starts it as soon as the job is prepared, so that its imports run beside the
launcher's own import of torch instead of after it. torch-free, so that the
launcher can start it before importing torch itself.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext

# torch and the launcher; then what each training rank imported after its fork: its loop, the checkpoint's
# torch.distributed.checkpoint (its first save or load) and torch._dynamo (which DTensor imports when the
# first checkpoint's shards are made), each about 1 s of CPU per rank on 2 cores, once here instead.
PRELOAD = ["hydraulis.runtime.parallelism.launch", "hydraulis.training.loop", "torch.distributed.checkpoint",
           "torch._dynamo", "hydraulis.processes.server_exit"]  # fmt: skip


def context() -> ForkServerContext:
    """multiprocessing's fork-server context, preloading what every rank imports."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start() -> None:
    """Start the server now; it imports in the background, and the first rank waits for it."""
    context()
    forkserver.ensure_running()
