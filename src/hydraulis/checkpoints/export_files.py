"""What an HF export holds beside the weights: tokenizer files, special-token ids, generation config.

The tokenizer is the one the run trained with. A checkpoint's manifest
names it (`tokenizer`); the run directory's `config.toml` (beside
`checkpoints/`) says where it came from (`[data] tokenizer`, `[model] init_from`):

- the built-in `bytes` and `gpt2` tokenizers are written as Hugging Face
  files that encode as ours (data/tokenizer.py `builtin_hf_files`); their
  ids are known (bytes: end of document 256, no bos; gpt2: 50256 for both);
- a Hugging Face tokenizer (a directory, or a `tokenizer.json`; with
  `tokenizer = "auto"` and `init_from`, the model directory's own) is
  copied file by file and its ids are read by transformers' AutoTokenizer.
  A `tokenizer.json` alone (no tokenizer_config.json beside it) declares no
  eos or bos: the export copies it with a minimal tokenizer_config.json and
  leaves the ids null.

A run records its paths absolute (training/config.py `RunConfig.resolved_values`),
so an export finds them from any directory. A tokenizer (or an `init_from`
model) that is not where the run recorded it is refused in one line naming
the path tried, before anything is written: `--no-tokenizer` (`--no-source-config`)
exports without it, never silently.

`config.json` starts from the source model's own config when the run began
from one (`init_from`), so its other fields (context length, initializer
range) survive, and gets the ids; `generation_config.json` gets them too,
so `generate` stops at the end of a document. The pad id is the source
model's (`pad_token_id`, kept as it was) when it has one, else the
tokenizer's, in both files.
"""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydraulis.checkpoints.manifest import CheckpointInfo
from hydraulis.errors import HydraulisError
from hydraulis.families import CONFIG_FILE, read_hf_config
from hydraulis.files import not_found

BUILTIN_IDS = {"bytes": (256, None), "gpt2": (50256, 50256)}  # name -> (eos, bos), data/tokenizer.py's ids
# The files of a Hugging Face tokenizer (slow or fast), as save_pretrained writes them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja")  # fmt: skip
GENERATION_FILE = "generation_config.json"
IDENTITY = re.compile(r"hf-[0-9a-f]{16}")  # a Hugging Face tokenizer's identity (data/hf_tokenizer.py), not a path


@dataclass(frozen=True)
class ExportSource:
    """Where a checkpoint's tokenizer and source config are, and the special-token ids."""

    tokenizer: str | None  # as the manifest (or the run's config) names it
    files: tuple[Path, ...]  # Hugging Face tokenizer files to copy
    builtin: str | None  # a built-in tokenizer to write as Hugging Face files (None: none, or files to copy)
    eos: int | None
    bos: int | None
    pad: int | None
    source_config: dict[str, Any] | None  # the init_from directory's config.json


def _run_config(info: CheckpointInfo) -> dict[str, Any]:
    """The run's config.toml (run/checkpoints/step-N -> run/config.toml), or {} when the checkpoint stands alone."""
    path = run_config_path(info)
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise HydraulisError(f"{path}: cannot read the run's config ({exc})") from None


def run_config_path(info: CheckpointInfo) -> Path:
    return info.path.parent.parent / "config.toml"


def _hf_tokenizer_files(path: Path) -> tuple[Path, ...]:
    if path.is_file():
        return (path,)
    if not path.is_dir():
        return ()
    return tuple(path / name for name in TOKENIZER_FILES if (path / name).is_file())


def _hf_ids(files: tuple[Path, ...], where: Path) -> tuple[int | None, int | None, int | None]:
    """(eos, bos, pad) of an HF tokenizer, read by transformers from its files."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if where.is_file():
            tok = PreTrainedTokenizerFast(tokenizer_file=str(where))
        else:
            tok = AutoTokenizer.from_pretrained(str(where))
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
        raise HydraulisError(f"{where}: not a Hugging Face tokenizer ({type(exc).__name__}: {exc})") from None
    return tok.eos_token_id, tok.bos_token_id, tok.pad_token_id


def _source_config(init_from: Path | None, info: CheckpointInfo, wanted: bool) -> dict[str, Any] | None:
    """The init_from model's config.json when it is the model trained; one line when the run's is gone."""
    if init_from is None or not wanted:
        return None
    if not (init_from / CONFIG_FILE).is_file():
        raise HydraulisError(not_found(
            init_from / CONFIG_FILE,
            "the run's init_from model is not there (the export keeps its pad_token_id and other fields); "
            "restore it, or pass --no-source-config to export without them",
        ))  # fmt: skip
    _, source_config, source_spec = read_hf_config(init_from)
    if [d for d in source_spec.tensor_differences(info.model) if d != "padded_vocab"]:
        return None  # not the model trained: its fields say nothing of this one
    return source_config


def export_source(info: CheckpointInfo, tokenizer: bool = True, source: bool = True) -> ExportSource:
    """The tokenizer and source config of a checkpoint's run (see the module docstring).

    tokenizer=False (`--no-tokenizer`) and source=False (`--no-source-config`) leave them out; otherwise one
    that is not where the run recorded it is refused, naming the path tried.
    """
    run = _run_config(info)
    data, model = run.get("data", {}), run.get("model", {})
    init_from = Path(model["init_from"]) if model.get("init_from") else None
    name = info.tokenizer or data.get("tokenizer")
    if name in BUILTIN_IDS:
        eos, bos = BUILTIN_IDS[name]
        builtin = name if tokenizer else None
        return ExportSource(tokenizer=name, files=(), builtin=builtin, eos=eos, bos=bos, pad=None,
                            source_config=_source_config(init_from, info, source))
    if not tokenizer:
        return ExportSource(tokenizer=name, files=(), builtin=None, eos=None, bos=None, pad=None,
                            source_config=_source_config(init_from, info, source))
    configured = data.get("tokenizer")
    paths = (n for n in (name, configured) if n and n not in BUILTIN_IDS and n != "auto" and not IDENTITY.fullmatch(n))
    candidates = [Path(n) for n in paths]
    if configured == "auto" and init_from is not None:
        candidates.append(init_from)
    where = next((p for p in candidates if _hf_tokenizer_files(p)), None)
    if where is None:
        raise HydraulisError(_missing_tokenizer(info, name, candidates))
    if where.name == "tokenizer.json" and (where.parent / "tokenizer_config.json").is_file():
        where = where.parent  # a saved tokenizer's file: its directory says which tokens are special
    files = _hf_tokenizer_files(where)
    eos, bos, pad = _hf_ids(files, where)
    return ExportSource(tokenizer=name, files=files, builtin=None, eos=eos, bos=bos, pad=pad,
                        source_config=_source_config(init_from, info, source))


def _missing_tokenizer(info: CheckpointInfo, name: str | None, candidates: list[Path]) -> str:
    """One line: the path looked for (the run's recorded tokenizer, else its config.toml), and the way out."""
    hint = "pass --no-tokenizer to export the model without one"
    if not candidates:  # the checkpoint alone, or a run config that names no tokenizer path
        what = "is not there" if not run_config_path(info).is_file() else "names no tokenizer path"
        return not_found(run_config_path(info), f"the run's config {what}, to find its tokenizer ({name}); {hint}")
    tried = candidates[-1]  # the most specific: the configured path, or the init_from model's for "auto"
    state = "holds no tokenizer files" if tried.exists() else "not there"
    return not_found(tried, f"the run's tokenizer ({name}) {state}; restore it there, or {hint}")


def pad_id(source: ExportSource) -> int | None:
    """The pad id the export declares: the source model's own (init_from) when it has one, else the tokenizer's."""
    own = (source.source_config or {}).get("pad_token_id")
    return own if isinstance(own, int) else source.pad


def with_special_ids(config: dict[str, Any], source: ExportSource) -> dict[str, Any]:
    """config.json: the source model's fields, then ours (what computes the model), then the tokenizer's ids."""
    merged = {**(source.source_config or {}), **config}
    merged.pop("torch_dtype" if "dtype" in config else "dtype", None)  # one dtype key, ours
    merged.update(eos_token_id=source.eos, bos_token_id=source.bos, pad_token_id=pad_id(source))
    return merged


def generation_config(source: ExportSource) -> dict[str, Any]:
    gen = {"bos_token_id": source.bos, "eos_token_id": source.eos}
    if pad_id(source) is not None:
        gen["pad_token_id"] = pad_id(source)
    return gen


def copy_tokenizer(source: ExportSource, out: Path) -> list[Path]:
    """The tokenizer's files into `out`: a built-in one written, an HF one copied (a lone tokenizer.json, of any
    name, gets a tokenizer_config.json)."""
    written = []
    if source.builtin is not None:
        from hydraulis.data.tokenizer import builtin_hf_files

        for file_name, text in builtin_hf_files(source.builtin).items():
            (out / file_name).write_text(text, encoding="utf-8")
            written.append(out / file_name)
        return written
    lone = len(source.files) == 1 and source.files[0].suffix == ".json"  # a tokenizer.json alone
    for f in source.files:
        target = out / ("tokenizer.json" if lone else f.name)
        try:
            shutil.copyfile(f, target)
        except OSError as exc:
            raise HydraulisError(f"{f}: cannot copy the tokenizer file: {exc.strerror or exc}") from None
        written.append(target)
    if lone:
        target = out / "tokenizer_config.json"
        target.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n", encoding="utf-8")
        written.append(target)
    return written
