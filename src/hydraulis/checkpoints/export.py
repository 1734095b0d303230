"""A checkpoint's model as a Hugging Face directory: `config.json` + `model.safetensors` of its family (families.py).

On ONE process without torch.distributed: DCP reads the whole fp32 master
vector (saver.py `load_master`), the layout's canonical order turns it into
full tensors, runtime/storage/hf.py renames them, and export_files.py adds
the tokenizer and its special ids. Written into a hidden temporary directory
and renamed into place, so a crash leaves no half-written model.
transformers is needed only to write `config.json`; torch is imported once the input is checked, so a
refusal (no checkpoint, its tokenizer or source config gone) is one line without it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from hydraulis.checkpoints.export_files import (
    GENERATION_FILE,
    copy_tokenizer,
    export_source,
    generation_config,
    with_special_ids,
)
from hydraulis.checkpoints.manifest import STEP_DIR, read_manifest, resolve_checkpoint
from hydraulis.errors import HydraulisError
from hydraulis.families import ARCHITECTURES, CONFIG_FILE, WEIGHTS_FILE
from hydraulis.files import default_mode, replace_directory
from hydraulis.progress import aside


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
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise HydraulisError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise HydraulisError(f"{out}: already exists (pass --force to replace it)")
    chosen = resolve_checkpoint(checkpoint, log=log or aside, sweep=False) or _no_checkpoint(Path(checkpoint))
    if chosen != Path(checkpoint) and log is not None:
        log(f"exporting {chosen}, the newest complete checkpoint of {checkpoint}")
    source = export_source(read_manifest(chosen), tokenizer, source_config)
    # torch only now: a refusal above (no checkpoint, a tokenizer or source config gone) needs none
    from safetensors.torch import save_file

    from hydraulis.checkpoints.saver import load_master
    from hydraulis.runtime.optimizer.layout import ShardLayout
    from hydraulis.runtime.storage.hf import hf_config, to_hf_state_dict
    from hydraulis.runtime.storage.hf_io import unflatten

    info, master = load_master(chosen)
    spec = info.model
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
