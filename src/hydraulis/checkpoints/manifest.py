"""Checkpoint directories on disk: names, the manifest, discovery and retention (no torch).

A checkpoint is a directory `step-000123` (the trainer step it resumes at)
whose `manifest.json` (`hydraulis.checkpoint/1`) is written last and lists
every file with its size and sha256; saver.py writes and reads
the tensors. Everything here runs without torch, so a job is checked before
any rank starts.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydraulis.cost.refit import RefitState
from hydraulis.data.sampler import SamplerState
from hydraulis.errors import HydraulisError
from hydraulis.files import Fields, load_json, not_found, sha256_file
from hydraulis.progress import Log, aside
from hydraulis.specs import SHAPE_FIELDS, Architecture, ModelSpec

CHECKPOINT_SCHEMA = "hydraulis.checkpoint/1"
MANIFEST_FILE = "manifest.json"
OPTIM_DIR = "optimizer"
OPTIM_KEYS = ("master", "exp_avg", "exp_avg_sq")
STEP_DIR = re.compile(r"step-(\d+)")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def rng_file(rank: int) -> str:
    return f"rng-{rank:05d}.json"


@dataclass(frozen=True)
class FileEntry:
    """A checkpoint file as the manifest records it."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint's manifest says (read without torch.distributed)."""

    path: Path
    step: int
    world_size: int
    model: ModelSpec
    parameters: int
    optimizer_step: int
    sampler: SamplerState
    schedule: dict[str, Any]  # lr, warmup, schedule, min_lr_ratio, total_steps
    seed: int
    pool: tuple[str, ...]
    tokenizer: str | None
    corpus_sha256: dict[str, str] | None
    files: dict[str, FileEntry]
    refit: RefitState | None = None  # the online refit the run planned with (cost/refit.py); None: not kept
    missed: tuple[str, ...] = ()  # pool deployments that could not hold some batch before it was saved

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST_FILE


def read_manifest(path: str | Path) -> CheckpointInfo:
    """A checkpoint directory's manifest, checked field by field (errors name the file)."""
    path = Path(path)
    if not path.is_dir():
        raise HydraulisError(not_found(path, "no such checkpoint directory"))
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        for holder in (path / "checkpoints", path):  # a run directory, or its checkpoints/ directory
            found = list_checkpoints(holder)
            if found:
                raise HydraulisError(
                    f"{path} is not a checkpoint but holds checkpoints; give one of them, "
                    f"e.g. {found[-1][1]} (the newest)"
                )
        raise HydraulisError(f"{path}: incomplete checkpoint (no {MANIFEST_FILE})")
    data = load_json(manifest, CHECKPOINT_SCHEMA)
    f = Fields(data, str(manifest))
    m = f.obj("model")
    try:
        arch = Architecture.from_dict(m.data.get("arch") or {}, f"{manifest}.model.arch")
        shape = {k: m.int(k, minimum=1) for k in SHAPE_FIELDS}
        spec = ModelSpec(m.str("name"), **shape, padded_vocab=m.int("padded_vocab", default=0, minimum=0), arch=arch)
    except HydraulisError as exc:
        raise HydraulisError(f"{manifest}: {exc}") from None
    files = {}
    for name, entry in f.obj("files").data.items():
        e = Fields(entry, f"{manifest}.files.{name}")
        files[name] = FileEntry(e.int("bytes", minimum=0), e.str("sha256"))
    try:
        sampler = SamplerState.from_dict(data.get("sampler"))
    except HydraulisError as exc:
        raise HydraulisError(f"{manifest}: {exc}") from None
    sums = None
    if data.get("corpus") is not None:
        sha = f.obj("corpus").obj("sha256")
        sums = {k: sha.str(k) for k in sha.data}
    pool = tuple(Fields(row, f"{manifest}.pool").str("text") for row in f.list("pool"))
    missed = data.get("missed", [])  # older checkpoints kept none
    if not isinstance(missed, list) or not all(isinstance(m, str) for m in missed):
        raise HydraulisError(f"{manifest}.missed: expected a list of deployment texts, got {missed!r}")
    tokenizer = data.get("tokenizer")
    if tokenizer is not None and not isinstance(tokenizer, str):
        raise HydraulisError(f"{manifest}.tokenizer: expected a string or null, got {tokenizer!r}")
    info = CheckpointInfo(
        path=path,
        step=f.int("step", minimum=0),
        world_size=f.int("world_size", minimum=1),
        model=spec,
        parameters=f.int("parameters", minimum=1),
        optimizer_step=f.obj("optimizer").int("step", minimum=0),
        sampler=sampler,
        schedule=dict(f.obj("schedule").data),
        seed=f.int("seed", minimum=0),
        pool=pool,
        tokenizer=tokenizer,
        corpus_sha256=sums,
        files=files,
        refit=None if data.get("refit") is None else RefitState.from_json(data["refit"], f"{manifest}.refit"),
        missed=tuple(missed),
    )
    if f"{OPTIM_DIR}/.metadata" not in files:
        raise HydraulisError(f"{manifest}: lists no {OPTIM_DIR}/.metadata")
    return info


def check_files(info: CheckpointInfo, names: Iterable[str] | None = None, hashes: bool = True) -> None:
    """Every listed file (or `names` of them) is there with its size and, with `hashes`, its checksum."""
    for name in info.files if names is None else names:
        entry = info.files[name]
        p = info.path / name
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise HydraulisError(f"{p}: missing (the checkpoint is incomplete)") from None
        if size != entry.bytes:
            state = "truncated" if size < entry.bytes else "too long"
            raise HydraulisError(f"{p}: {state}: {size} bytes, {info.manifest_path} says {entry.bytes}")
        if hashes and sha256_file(p) != entry.sha256:
            raise HydraulisError(f"{p}: corrupt: its checksum differs from {info.manifest_path}")


def check_visible(tmp: Path, files: dict[str, FileEntry]) -> None:
    """Before rank 0 publishes: every rank's file is there, with the size its writer reported."""
    for name, entry in sorted(files.items()):
        p = tmp / name
        size = p.stat().st_size if p.is_file() else None
        if size != entry.bytes:
            state = "missing" if size is None else f"{size} bytes, its writer reported {entry.bytes}"
            raise HydraulisError(
                f"{p}: {state} as rank 0 sees it; the checkpoint is not published (is the run directory "
                "shared by all nodes? use a shared file system path for [train] out)"
            )


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step-N` directory under out_dir, oldest first (complete or not)."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := STEP_DIR.fullmatch(p.name))]
    return sorted(found)


def sweep_temporary(out_dir: str | Path, log: Log = aside) -> list[Path]:
    """Remove the hidden temporary directories of saves that did not finish (one line each).

    A `.old` directory still holding the only copy of a checkpoint (a save
    killed in the middle of replacing the same step) is put back first.
    """
    out = Path(out_dir)
    swept = []
    if out.is_dir():
        for p in sorted(out.iterdir()):
            if p.is_dir() and p.name.startswith(".step-") and p.name.endswith((".tmp", ".old")):
                for kept in p.iterdir() if p.name.endswith(".old") else ():
                    if STEP_DIR.fullmatch(kept.name) and not (out / kept.name).exists():
                        kept.replace(out / kept.name)
                        log(f"restored {out / kept.name} from {p}: a save replacing it did not finish")
                shutil.rmtree(p, ignore_errors=True)
                log(f"removed {p}: a checkpoint save that did not finish")
                swept.append(p)
    return swept


def verify_checkpoint(path: str | Path) -> CheckpointInfo:
    """The manifest of a checkpoint whose every file is there with its size and sha256 (else one line why)."""
    info = read_manifest(path)
    check_files(info, hashes=False)  # the cheap checks first: a missing or truncated file needs no hashing
    check_files(info)
    return info


def latest_checkpoint(out_dir: str | Path, sweep: bool = True, log: Log = aside) -> Path | None:
    """The newest checkpoint under out_dir that verifies completely; None when there is no checkpoint at all.

    One rule for every kind of damage (no manifest, a missing, truncated or
    byte-flipped file): the checkpoint is skipped, and one line names every
    skipped one and why. When checkpoints exist but none verifies, it raises
    without changing anything, so a resume never trains from scratch over
    them. Only once one is chosen (or there are none), with `sweep`, are
    temporary directories of unfinished saves removed.
    """
    found = list_checkpoints(out_dir)
    skipped: list[str] = []
    chosen = None
    for _, path in reversed(found):
        try:
            verify_checkpoint(path)
        except HydraulisError as exc:
            skipped.append(str(exc))
            continue
        chosen = path
        break
    if found and chosen is None:
        raise HydraulisError(
            f"{out_dir}: none of its {len(found)} checkpoint(s) verifies ({'; '.join(skipped)}); "
            "nothing was changed: restore a checkpoint, or start a new run with another --out"
        )
    if skipped:
        log(f"skipping {len(skipped)} damaged checkpoint(s): {'; '.join(skipped)}; using {chosen}")
    if sweep:
        sweep_temporary(out_dir, log)
    return chosen


def resolve_checkpoint(path: str | Path, log: Log = aside, sweep: bool = True) -> Path | None:
    """A checkpoint directory itself, or the newest verifying one under an output directory or a run directory
    (its checkpoints/); sweep=False changes nothing on disk (an export only reads)."""
    path = Path(path)
    if (path / MANIFEST_FILE).exists() or STEP_DIR.fullmatch(path.name):
        return path
    if list_checkpoints(path / "checkpoints"):
        path = path / "checkpoints"
    return latest_checkpoint(path, sweep=sweep, log=log)


def prune(out_dir: str | Path, keep: int, spare: Path) -> None:
    """After `spare` is published, delete older complete checkpoints beyond the newest `keep` (<= 0 keeps all).

    Only checkpoints at or before `spare`'s step count and go: a newer one
    (left by a run resumed from an earlier step) is never rotated away before
    this run has saved past it.
    """
    if keep <= 0:
        return
    limit = int(STEP_DIR.fullmatch(spare.name).group(1))  # type: ignore[union-attr]
    complete = [p for s, p in list_checkpoints(out_dir) if s <= limit and (p / MANIFEST_FILE).is_file()]
    for p in complete[:-keep]:
        if p != spare:
            shutil.rmtree(p, ignore_errors=True)
