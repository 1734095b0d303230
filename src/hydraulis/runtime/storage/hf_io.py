"""Hugging Face weights in: `config.json` + `model.safetensors` of the LLaMA line (families.py).

`init_from`: an HF directory into the optimizer's owned range. Each owner
reads from the safetensors file only the rows (or, for the row-parallel
weights stored transposed in canonical order, the columns) that overlap
its range, so no rank ever loads the whole model. It reads the config as
plain JSON and the weights with safetensors, without transformers.
`unflatten` turns the global vector into full tensors (the export's way out
is checkpoints/export.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hydraulis.errors import HydraulisError
from hydraulis.families import check_weights, read_hf_config
from hydraulis.runtime.optimizer.layout import FlatParam, ShardLayout
from hydraulis.runtime.storage.hf import VOCAB_TENSORS, hf_name
from hydraulis.specs import ModelSpec

if TYPE_CHECKING:
    from hydraulis.runtime.optimizer.sharded import ShardedOptimizer


def unflatten(layout: ShardLayout, vector: torch.Tensor) -> dict[str, torch.Tensor]:
    """The whole global vector as full-shape tensors (contiguous), in model order."""
    if vector.numel() != layout.total:
        raise HydraulisError(f"global vector of {vector.numel()} elements, the model has {layout.total}")
    out = {}
    for p in layout.params:
        out[p.name] = p.from_canonical(vector[p.offset : p.offset + p.numel])
    return out


# -- import ---------------------------------------------------------------------------------------
def _read_range(sl: Any, p: FlatParam, start: int, stop: int, rows: int) -> torch.Tensor:
    """Canonical elements [start, stop) of one parameter, read as a slice of its full tensor.

    The file holds `rows` canonical rows; those beyond (a padded vocabulary's) are zeros.
    """
    if len(p.full_shape) == 1:
        return sl[start:stop].float().reshape(-1)
    cols = p.canonical_shape[1]  # canonical rows: full rows, or full columns when transposed
    r0, r1 = start // cols, -(-stop // cols)
    if p.transposed:
        block = sl[:, r0:r1].t()
    else:  # rows past the file's (a padded vocabulary) are zeros
        block = sl[r0 : min(r1, rows)] if r0 < rows else torch.empty(0, cols)
        if r1 > rows:
            block = torch.cat([block.float(), torch.zeros(r1 - max(r0, rows), cols)])
    return block.float().reshape(-1)[start - r0 * cols : stop - r0 * cols]


@torch.no_grad()
def init_from(opt: ShardedOptimizer, hf_dir: str | Path) -> ModelSpec:
    """Fill the owned range of the master weights from an HF directory (families.py); padded rows are zeros.

    Each rank reads only the slices of tensors in its range; every name and
    shape is checked before the master changes. Call it before training (the
    AdamW moments stay zero and the step count is untouched).
    """
    from safetensors import safe_open

    layout: ShardLayout = opt.layout
    owned = layout.owned_ranges(opt.rank)  # the ranges of the master this rank fills
    hf_dir = Path(hf_dir)
    config_path, _, spec = read_hf_config(hf_dir)
    differ = [d for d in spec.tensor_differences(layout.spec) if d != "padded_vocab"]
    if differ:
        mine = layout.spec.describe()
        raise HydraulisError(f"{config_path}: model {spec.describe()}, this run's model is {mine} ({differ[0]})")
    files = check_weights(hf_dir, spec)  # every name and shape first (job.py checked them too), then the values
    fresh = torch.empty(layout.owned_size(opt.rank), dtype=torch.float32)
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for p in layout.params:
            pieces = [(max(lo, p.offset), min(hi, p.offset + p.numel)) for lo, hi in owned]
            pieces = [(a, b) for a, b in pieces if a < b]
            if not pieces:
                continue
            name = hf_name(p.name)
            file = files[name]
            if file not in handles:
                try:
                    handles[file] = stack.enter_context(safe_open(str(file), framework="pt"))
                except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
                    raise HydraulisError(f"{file}: cannot open as safetensors ({exc})") from None
            rows = spec.vocab if p.name in VOCAB_TENSORS else p.full_shape[0]
            sl = handles[file].get_slice(name)
            for a, b in pieces:  # one per stripe: the owner's chunk of it
                lo, hi = layout.to_local(opt.rank, a, b)
                fresh[lo:hi] = _read_range(sl, p, a - p.offset, b - p.offset, rows)
    opt.master.copy_(fresh.to(opt.device))
    return spec
