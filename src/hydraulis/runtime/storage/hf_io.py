"""Hugging Face checkpoints in and out: `config.json` + `model.safetensors` of the LLaMA line (families.py).

- `export_hf`: a hydraulis checkpoint (checkpoint.py) to an HF directory, on
  ONE process without torch.distributed: DCP reads the whole fp32 master
  vector, the layout's canonical order turns it into full tensors, hf.py
  renames them. Written into a hidden temporary directory and renamed into
  place, so a crash leaves no half-written model.
- `init_from`: an HF directory into the optimizer's owned range. Each owner
  reads from the safetensors file only the rows (or, for the row-parallel
  weights stored transposed in canonical order, the columns) that overlap
  its range, so no rank ever loads the whole model.

transformers is needed only to write `config.json` on export; import reads
the config as plain JSON and the weights with safetensors.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hydraulis.errors import HydraulisError
from hydraulis.families import ARCHITECTURES, CONFIG_FILE, WEIGHTS_FILE, check_weights, read_hf_config
from hydraulis.files import default_mode, replace_directory
from hydraulis.progress import aside
from hydraulis.runtime.optimizer.layout import FlatParam, ShardLayout
from hydraulis.runtime.storage.checkpoint import load_master
from hydraulis.runtime.storage.export_files import (
    GENERATION_FILE,
    copy_tokenizer,
    export_source,
    generation_config,
    with_special_ids,
)
from hydraulis.runtime.storage.hf import VOCAB_TENSORS, hf_config, hf_name, to_hf_state_dict
from hydraulis.specs import ModelSpec
from hydraulis.store.checkpoints import STEP_DIR, resolve_checkpoint

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


# -- export ----------------------------------------------------------------------------------------
def _no_checkpoint(path: Path) -> Path:
    """`path` when it is meant as a checkpoint itself (its load names what is missing); a run directory or
    another directory without one is one line saying so and what to do."""
    if STEP_DIR.fullmatch(path.name) or not path.is_dir():
        return path
    if (path / "config.toml").is_file() or (path / "checkpoints").is_dir():
        raise HydraulisError(
            f"{path}: the run has no checkpoint yet (a run saves one at its end, every [train] checkpoint_every "
            "steps, at --stop-at K and on Ctrl-C); wait for one, or continue the run (`hydraulis train --config "
            f"{path / 'config.toml'} --out {path} --resume`), then export"
        )
    raise HydraulisError(f"{path}: holds no checkpoint (step-NNNNNN/manifest.json) and is no run directory; "
                         "give --checkpoint a run directory or one of its checkpoints/step-NNNNNN")


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    force: bool = False,
    max_position_embeddings: int | None = None,
    log: Callable[[str], None] | None = None,
    tokenizer: bool = True,
    source_config: bool = True,
) -> list[Path]:
    """Write a checkpoint's model as an HF directory of its family; returns the files written.

    Beside the weights: config.json with the tokenizer's special ids,
    generation_config.json and the tokenizer's files (export_files.py).
    max_position_embeddings: None takes the source model's (init_from), else 4096.
    `checkpoint` may be a run directory (or its checkpoints/): its newest complete checkpoint.
    tokenizer / source_config False: export without the tokenizer / the init_from model's config fields.
    Everything is read and checked before anything is written; `out` must not
    exist (or be empty) unless `force`.
    """
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise HydraulisError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise HydraulisError(f"{out}: already exists (pass --force to replace it)")
    chosen = resolve_checkpoint(checkpoint, log=log or aside, sweep=False) or _no_checkpoint(Path(checkpoint))
    if chosen != Path(checkpoint) and log is not None:
        log(f"exporting {chosen}, the newest complete checkpoint of {checkpoint}")
    info, master = load_master(chosen)
    spec = info.model
    source = export_source(info, tokenizer, source_config)
    tensors = to_hf_state_dict(unflatten(ShardLayout(spec, 1), master), spec)
    if max_position_embeddings is None:
        max_position_embeddings = (source.source_config or {}).get("max_position_embeddings") or 4096
    config = hf_config(spec, max_position_embeddings).to_dict()
    config["architectures"] = [ARCHITECTURES[spec.arch.family]]
    config["dtype" if "dtype" in config else "torch_dtype"] = "float32"  # transformers 5 / 4
    config = with_special_ids(config, source)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as exc:
        raise HydraulisError(f"{out}: cannot create the output directory: {exc.strerror or exc}") from None
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        gen = json.dumps(generation_config(source), indent=2, sort_keys=True) + "\n"
        (tmp / GENERATION_FILE).write_text(gen, encoding="utf-8")
        meta = {"format": "pt", "hydraulis_checkpoint": str(info.path), "hydraulis_step": str(info.step)}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata=meta)
        tokenizer_files = [out / p.name for p in copy_tokenizer(source, tmp)]
        default_mode(tmp)
        for p in tmp.iterdir():
            default_mode(p)
        replace_directory(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    written = [out / CONFIG_FILE, out / GENERATION_FILE, out / WEIGHTS_FILE, *tokenizer_files]
    if log is not None:
        for p in written:
            log(f"wrote {p} ({p.stat().st_size:,} bytes)")
    return written


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
