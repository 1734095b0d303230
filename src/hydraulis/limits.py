"""Bounds on every number a user can give, so that work, memory and int64 arithmetic stay bounded.

With lengths below 2^31 and at most 2^22 sequences per batch, any sum of
lengths stays below 2^53: int64 sums cannot overflow and float64 holds them
exactly (squares go through float64, see cost.model.sequence_costs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hydraulis.errors import HydraulisError

INT64_MAX = 2**63 - 1
MAX_LENGTH = 2**31 - 1  # tokens in one sequence
MAX_SEQUENCES = 2**22  # sequences in one global batch
MAX_TOKENS_PER_BATCH = 2**32  # a global batch's token budget (ordinary batches: 2^24-2^25)
MAX_BATCHES = 100_000  # global batches in one workload
MAX_GPUS = 16384
DEFAULT_MAX_POOL = 6  # deployments a proposed pool may hold: `propose --max-pool`, [parallel] max_pool
MAX_POOL = 64
MAX_SEED = 2**63 - 1
MAX_MODEL_DIM = 2**24  # hidden, ffn, vocab, heads of a model
MAX_LAYERS = 4096
DEFAULT_EXCHANGE_BUCKET_BYTES = 256 << 20  # [parallel] exchange_bucket_mb's default, sized for GPUs
DEFAULT_TIMEOUT_S = 600.0  # [train] timeout_s: process-group timeout after the first step (parallelism/timeouts.py)
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_MEMORY_BYTES = 2**50  # a memory size (a device's, a budget per rank)
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def check_int(value: int, name: str, minimum: int, maximum: int, hint: str = "") -> int:
    """`value` within [minimum, maximum], or a HydraulisError naming it and the range."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
            value = int(value)
        else:
            raise HydraulisError(f"{name}: expected an integer, got {value!r}")
    if not minimum <= value <= maximum:
        raise HydraulisError(f"{name} must be between {minimum} and {maximum}, got {short_repr(value)}{hint}")
    return value


def check_batch_size(expected_sequences: float, where: str) -> None:
    """Refuse a batch that would hold more sequences than the planner is bounded for."""
    if not math.isfinite(expected_sequences) or expected_sequences > MAX_SEQUENCES:
        raise HydraulisError(
            f"{where}: a global batch would hold about {expected_sequences:.3g} sequences, more than the "
            f"{MAX_SEQUENCES:,} allowed; lower the token budget or use longer sequences"
        )


def finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def short_repr(value: object) -> str:
    """A value for an error line: huge integers as 1e+30, not thirty digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**15:
        return f"{float(value):.3g}" if finite(value) else f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_size(value: str | int, name: str) -> int:
    """Bytes of a memory size: an integer, or a number with a unit ("96MiB", "70GB", "1.5 GiB"; KB, MB, GB
    and TB are powers of 1000, KiB, MiB, GiB and TiB of 1024); a HydraulisError naming `name` otherwise."""
    import re

    if isinstance(value, bool) or not isinstance(value, int | str):
        raise HydraulisError(f"{name}: expected a size like \"96MiB\" or \"70GB\", got {short_repr(value)}")
    text = str(value).strip()
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in SIZE_UNITS:
        raise HydraulisError(
            f"{name}: {short_repr(value)} is not a size; write a number and a unit, like \"96MiB\" or \"70GB\""
        )
    size = int(float(match.group(1)) * SIZE_UNITS[unit])
    if not 1 <= size <= MAX_MEMORY_BYTES:
        raise HydraulisError(f"{name}: {short_repr(value)} must be between 1 byte and 1 PiB")
    return size


def check_lengths(lengths: Sequence[int] | np.ndarray, where: str = "batch") -> np.ndarray:
    """A non-empty array of positive integer lengths, or a clear error."""
    arr = np.asarray(lengths)
    if arr.ndim != 1 or len(arr) == 0:
        raise HydraulisError(f"{where}: empty batch; a global batch needs at least one sequence")
    if not np.issubdtype(arr.dtype, np.integer):
        raise HydraulisError(f"{where}: sequence lengths must be integers")
    if (arr < 1).any():
        bad = int(arr[arr < 1][0])
        raise HydraulisError(f"{where}: sequence length must be positive, got {bad}")
    if (arr > MAX_LENGTH).any():
        raise HydraulisError(f"{where}: a sequence of {int(arr.max())} tokens; lengths must be below 2^31")
    if len(arr) > MAX_SEQUENCES:
        raise HydraulisError(f"{where}: {len(arr):,} sequences, more than the {MAX_SEQUENCES:,} a batch may hold")
    return arr.astype(np.int64)
