"""Checkpoints of training: the fixed optimizer layout with torch.distributed.checkpoint (DCP).

A checkpoint is a directory `step-000123` (the trainer step it resumes at):

    manifest.json       `hydraulis.checkpoint/1`: model, tokenizer, corpus checksums, world size,
                        step, sampler state, LR schedule inputs, pool, and every file's size and
                        sha256; written last, so its presence marks a complete checkpoint
    optimizer/          DCP: `.metadata` and one `__R_0.distcp` per saving rank
    rng-00000.json ...  each rank's torch, numpy and python RNG states

Each rank writes only what it owns (layout.py): its ranges of the fp32
master, exp_avg and exp_avg_sq, each as the local shard of a 1-D DTensor
sharded on dim 0 over all ranks. The owner ranges are torch.chunk sizes,
exactly DTensor's Shard(0), so DCP reshards on load: a job of another world
size (and so another pool) reads the intersections of its new ranges.

Atomic: ranks write into a hidden `.step-000123.tmp` next to the target,
rank 0 writes the manifest and renames the directory into place, and only
then deletes checkpoints beyond the last `keep`. A checkpoint without a
manifest, with a missing or truncated file, or a temporary directory is
never loaded: `latest_checkpoint` skips it (and sweeps temporary
directories), saying so in one line. Loading checks everything (schema,
model shape, corpus, files, checksums) on every rank before it changes
anything, and all ranks raise the same `HydraulisError`.

Checkpoint directories must be visible to every rank (one machine, or a
shared file system). DCP's `.metadata` is a pickle: its checksum is checked
before it is read, but load only checkpoints you trust.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import os
import random
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from hydraulis.data.sampler import SamplerState
from hydraulis.errors import HydraulisError
from hydraulis.jsonio import Fields, load_json, write_json_atomic
from hydraulis.specs import ModelSpec

if TYPE_CHECKING:
    from hydraulis.runtime.layout import ModelLayout
    from hydraulis.runtime.trainer import Trainer

CHECKPOINT_SCHEMA = "hydraulis.checkpoint/1"
MANIFEST_FILE = "manifest.json"
OPTIM_DIR = "optimizer"
OPTIM_KEYS = ("master", "exp_avg", "exp_avg_sq")
STEP_DIR = re.compile(r"step-(\d+)")
DEFAULT_KEEP = 3
_SHAPE_FIELDS = ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab")

T = TypeVar("T")
Log = Callable[[str], None]


def say(message: str) -> None:
    """Default log: one line on stderr."""
    print(message, file=sys.stderr, flush=True)


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

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST_FILE


# -- reading and checking (no torch.distributed) -------------------------------------------------
def spec_to_dict(spec: ModelSpec) -> dict[str, Any]:
    return asdict(spec)


def same_shape(a: ModelSpec, b: ModelSpec) -> bool:
    return all(getattr(a, k) == getattr(b, k) for k in _SHAPE_FIELDS)


def describe(spec: ModelSpec) -> str:
    return f"{spec.name} ({', '.join(f'{k}={getattr(spec, k)}' for k in _SHAPE_FIELDS)})"


def read_manifest(path: str | Path) -> CheckpointInfo:
    """A checkpoint directory's manifest, checked field by field (errors name the file)."""
    path = Path(path)
    if not path.is_dir():
        raise HydraulisError(f"{path}: no such checkpoint directory")
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        raise HydraulisError(f"{path}: incomplete checkpoint (no {MANIFEST_FILE})")
    data = load_json(manifest, CHECKPOINT_SCHEMA)
    f = Fields(data, str(manifest))
    m = f.obj("model")
    try:
        spec = ModelSpec(m.str("name"), **{k: m.int(k, minimum=1) for k in _SHAPE_FIELDS})
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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_compatible(info: CheckpointInfo, layout: ModelLayout) -> None:
    """The checkpoint holds this model's global vector (manifest and DCP metadata agree with the layout)."""
    if not same_shape(info.model, layout.spec):
        raise HydraulisError(
            f"{info.manifest_path}: checkpoint of model {describe(info.model)}, "
            f"this run's model is {describe(layout.spec)}"
        )
    meta_path = info.path / OPTIM_DIR / ".metadata"
    try:
        import torch.distributed.checkpoint as dcp

        meta = dcp.FileSystemReader(str(info.path / OPTIM_DIR)).read_metadata()
        sizes = {k: tuple(meta.state_dict_metadata[k].size) for k in OPTIM_KEYS}
    except Exception as exc:  # noqa: BLE001 - a damaged file may fail in many ways inside DCP
        raise HydraulisError(f"{meta_path}: cannot read the DCP metadata: {type(exc).__name__}: {exc}") from None
    for key, size in sizes.items():
        if size != (layout.total,) or info.parameters != layout.total:
            raise HydraulisError(
                f"{meta_path}: {key} has shape {size}, the model's global vector has {layout.total} elements"
            )


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step-N` directory under out_dir, oldest first (complete or not)."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := STEP_DIR.fullmatch(p.name))]
    return sorted(found)


def sweep_temporary(out_dir: str | Path, log: Log = say) -> list[Path]:
    """Remove the hidden temporary directories of saves that did not finish (one line each)."""
    out = Path(out_dir)
    swept = []
    if out.is_dir():
        for p in sorted(out.iterdir()):
            if p.is_dir() and p.name.startswith(".step-") and p.name.endswith((".tmp", ".old")):
                shutil.rmtree(p, ignore_errors=True)
                log(f"removed {p}: a checkpoint save that did not finish")
                swept.append(p)
    return swept


def latest_checkpoint(out_dir: str | Path, sweep: bool = True, log: Log = say) -> Path | None:
    """The newest complete checkpoint under out_dir (None if there is none).

    Complete: a manifest of our schema whose files are all there with their
    sizes (checksums are checked when loading). Incomplete ones are skipped
    with one line each; with `sweep`, temporary directories are removed.
    """
    if sweep:
        sweep_temporary(out_dir, log)
    for _, path in reversed(list_checkpoints(out_dir)):
        try:
            check_files(read_manifest(path), hashes=False)
        except HydraulisError as exc:
            log(f"skipping an incomplete checkpoint: {exc}")
            continue
        return path
    return None


def resolve_checkpoint(path: str | Path, log: Log = say) -> Path | None:
    """A checkpoint directory itself, or the newest complete one under an output directory."""
    path = Path(path)
    if (path / MANIFEST_FILE).exists() or STEP_DIR.fullmatch(path.name):
        return path
    return latest_checkpoint(path, log=log)


# -- collectives ------------------------------------------------------------------------------------
def _control(trainer: Trainer) -> dist.ProcessGroup | None:
    return trainer.control


def _agree(trainer: Trainer, fn: Callable[[], T]) -> T:
    """fn() on every rank; if any raised a HydraulisError, every rank raises the first one (none is left waiting)."""
    try:
        result, error = fn(), None
    except HydraulisError as exc:
        result, error = None, str(exc)
    errors = [error]
    if trainer.world > 1:
        errors = [None] * trainer.world
        dist.all_gather_object(errors, error, group=_control(trainer))
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise HydraulisError(first)
    return result  # type: ignore[return-value]


def _gather(trainer: Trainer, obj: Any) -> list[Any]:
    if trainer.world == 1:
        return [obj]
    out: list[Any] = [None] * trainer.world
    dist.all_gather_object(out, obj, group=_control(trainer))
    return out


def _writer(name: str) -> int:
    """The rank that wrote a checkpoint file (`__R_0.distcp`, `rng-R.json`; rank 0 the rest): it hashes it."""
    m = re.fullmatch(r"(?:optimizer/__(\d+)_\d+\.distcp|rng-(\d+)\.json)", name)
    return int(m.group(1) or m.group(2)) if m else 0


def _sharded(trainer: Trainer, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Owned ranges as local shards of 1-D DTensors over the world (Shard(0): the layout's owner ranges)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    opt = trainer.optimizer
    mesh = init_device_mesh(opt.device.type, (trainer.world,))
    total = torch.Size([trainer.layout.total])
    return {
        k: DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=total, stride=(1,))
        for k, t in tensors.items()
    }


# -- RNG states --------------------------------------------------------------------------------------
def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's torch, numpy and python RNG states as JSON (no pickle in a checkpoint)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss_next = random.getstate()
    out: dict[str, Any] = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": {
            "kind": kind,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": version, "state": list(state), "gauss_next": gauss_next},
    }
    if device.type == "cuda":
        out["cuda"] = base64.b64encode(torch.cuda.get_rng_state(device).numpy().tobytes()).decode()
    return out


def set_rng_state(data: dict[str, Any], device: torch.device, where: str) -> None:
    try:
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(data["torch"])), dtype=torch.uint8))
        n = data["numpy"]
        np.random.set_state(
            (n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
        p = data["python"]
        random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
        if device.type == "cuda" and "cuda" in data:
            state = torch.frombuffer(bytearray(base64.b64decode(data["cuda"])), dtype=torch.uint8)
            torch.cuda.set_rng_state(state, device)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise HydraulisError(f"{where}: not a valid RNG state ({type(exc).__name__}: {exc})") from None


# -- save ----------------------------------------------------------------------------------------------
def _manifest(trainer: Trainer, files: dict[str, FileEntry]) -> dict[str, Any]:
    s = trainer.settings
    o = s.optim
    corpus_manifest = getattr(trainer.corpus, "manifest", None)
    corpus = None
    tokenizer = None
    if corpus_manifest is not None:
        tokenizer = corpus_manifest.tokenizer
        corpus = {"name": corpus_manifest.name, "sha256": dict(corpus_manifest.checksums)}
    return {
        "schema": CHECKPOINT_SCHEMA,
        "step": trainer.step_index,
        "world_size": trainer.world,
        "model": spec_to_dict(s.model),
        "parameters": trainer.layout.total,
        "tokenizer": tokenizer,
        "corpus": corpus,
        "optimizer": {"step": trainer.optimizer.step_count, "adamw": asdict(o.adamw)},
        "sampler": trainer.next_sampler_state().to_dict(),
        "schedule": {
            "lr": o.lr,
            "warmup": o.warmup,
            "schedule": o.schedule,
            "min_lr_ratio": o.min_lr_ratio,
            "total_steps": s.steps,
        },
        "seed": s.seed,
        "dtype": s.dtype,
        "pool": [{"text": str(d), "replicas": d.to_rows()} for d in s.pool],
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "files": {k: asdict(v) for k, v in sorted(files.items())},
    }


def save_checkpoint(trainer: Trainer, out_dir: str | Path, keep: int = DEFAULT_KEEP, log: Log = say) -> Path:
    """Save the trainer's state as out_dir/step-NNNNNN (every rank calls it); returns the directory.

    Older checkpoints beyond the newest `keep` are deleted after the new one
    is complete (keep <= 0 keeps all).
    """
    import torch.distributed.checkpoint as dcp

    out = Path(out_dir)
    name = step_dir_name(trainer.step_index)
    final, tmp = out / name, out / f".{name}.tmp"
    rank = trainer.rank

    def prepare() -> None:
        if rank != 0:
            return
        try:
            out.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
                log(f"removed {tmp}: a checkpoint save that did not finish")
            (tmp / OPTIM_DIR).mkdir(parents=True)
        except OSError as exc:
            raise HydraulisError(f"{out}: cannot create the checkpoint directory: {exc.strerror or exc}") from None

    _agree(trainer, prepare)
    opt = trainer.optimizer
    state = _sharded(trainer, {k: getattr(opt, k) for k in OPTIM_KEYS})
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp / OPTIM_DIR)), process_group=_control(trainer))
    write_json_atomic(tmp / rng_file(rank), rng_state(opt.device))
    _gather(trainer, None)  # a barrier: every rank's files are written
    names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file() and not p.name.endswith(".tmp"))
    mine = {n: FileEntry((tmp / n).stat().st_size, sha256_file(tmp / n)) for n in names if _writer(n) == rank}
    files = {k: v for part in _gather(trainer, mine) for k, v in part.items()}

    def publish() -> None:
        if rank != 0:
            return
        old = out / f".{name}.old"
        try:
            write_json_atomic(tmp / MANIFEST_FILE, _manifest(trainer, files))  # last: marks it complete
            shutil.rmtree(old, ignore_errors=True)
            if final.exists():  # the same step saved again (e.g. right after a resume): replace it
                os.replace(final, old)
            os.replace(tmp, final)
        except OSError as exc:
            raise HydraulisError(f"{final}: cannot publish the checkpoint: {exc.strerror or exc}") from None
        shutil.rmtree(old, ignore_errors=True)
        if keep > 0:
            complete = [p for _, p in list_checkpoints(out) if (p / MANIFEST_FILE).is_file()]
            for p in complete[:-keep]:
                if p != final:
                    shutil.rmtree(p, ignore_errors=True)

    _agree(trainer, publish)
    return final


# -- load ----------------------------------------------------------------------------------------------
def load_checkpoint(trainer: Trainer, path: str | Path, verify: bool = True, log: Log = say) -> CheckpointInfo:
    """Put a checkpoint's state into the trainer (every rank calls it), whatever world size saved it.

    Everything is checked first (with `verify`, every file's checksum, the
    files spread over the ranks); only then are the optimizer, the step, the
    sampler and the RNGs replaced. The next `step()` trains exactly the batch
    an uninterrupted run would have trained next.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    world, rank = trainer.world, trainer.rank

    def check() -> CheckpointInfo:
        info = read_manifest(path)
        check_files(info, hashes=False)
        check_files(info, [f"{OPTIM_DIR}/.metadata"])  # checked before DCP unpickles it
        check_compatible(info, trainer.layout)
        ours = getattr(trainer.corpus, "manifest", None)
        if ours is not None and info.corpus_sha256 is not None and dict(ours.checksums) != info.corpus_sha256:
            raise HydraulisError(
                f"{info.manifest_path}: saved while training on another corpus (its checksums differ from "
                f"{getattr(trainer.corpus, 'path', 'this corpus')}'s manifest)"
            )
        previous = trainer.sampler.state
        try:
            trainer.sampler.state = info.sampler  # the setter checks the position against the corpus
        except HydraulisError as exc:
            raise HydraulisError(f"{info.manifest_path}: {exc}") from None
        finally:
            trainer.sampler.state = previous
        if verify:
            check_files(info, sorted(info.files)[rank::world])  # every file once, the reading spread over ranks
        return info

    info = _agree(trainer, check)
    opt = trainer.optimizer
    fresh = {k: torch.zeros_like(getattr(opt, k)) for k in OPTIM_KEYS}

    def read() -> None:
        try:
            dcp.load(
                _sharded(trainer, fresh),
                storage_reader=dcp.FileSystemReader(str(path / OPTIM_DIR)),
                process_group=_control(trainer),
            )
        except Exception as exc:  # noqa: BLE001 - DCP wraps every rank's read error
            raise HydraulisError(f"{path / OPTIM_DIR}: cannot read the optimizer state: {exc}") from None
        own = path / rng_file(rank)
        source = own if own.name in info.files else path / rng_file(0)
        rng = load_json_plain(source)
        set_rng_state(rng, opt.device, str(source))

    _agree(trainer, read)
    for k, t in fresh.items():
        getattr(opt, k).copy_(t)
    opt.step_count = info.optimizer_step
    trainer.restore(info.step, info.sampler)
    s = trainer.settings
    now = {
        "lr": s.optim.lr,
        "warmup": s.optim.warmup,
        "schedule": s.optim.schedule,
        "min_lr_ratio": s.optim.min_lr_ratio,
        "total_steps": s.steps,
    }
    changed = [k for k, v in now.items() if info.schedule.get(k) != v]
    if changed and rank == 0:
        log(
            f"resuming {path} with another LR schedule: "
            + ", ".join(f"{k} {info.schedule.get(k)} -> {now[k]}" for k in changed)
        )
    return info


def load_json_plain(path: Path) -> dict[str, Any]:
    """A JSON object without a schema key (RNG files)."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HydraulisError(f"{path}: cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise HydraulisError(f"{path}: expected a JSON object")
    return data


def resume(trainer: Trainer, path: str | Path, verify: bool = True, log: Log = say) -> CheckpointInfo | None:
    """Load the checkpoint at `path` or the newest complete one under it (every rank calls it).

    Rank 0 picks it (sweeping temporary directories, skipping incomplete
    checkpoints, one line each) and tells the others; None when there is none.
    """

    def pick() -> str | None:
        if trainer.rank != 0:
            return None
        found = resolve_checkpoint(path, log=log)
        return None if found is None else str(found)

    chosen = _gather(trainer, _agree(trainer, pick))[0]
    if chosen is None:
        return None
    return load_checkpoint(trainer, chosen, verify=verify, log=log)


# -- single-process reading (export) ------------------------------------------------------------------
def load_master(path: str | Path, verify: bool = True) -> tuple[CheckpointInfo, torch.Tensor]:
    """A checkpoint's whole fp32 master vector on one process, without torch.distributed."""
    import torch.distributed.checkpoint as dcp

    from hydraulis.runtime.layout import ModelLayout

    info = read_manifest(path)
    check_files(info, hashes=False)
    check_files(info, hashes=verify)
    layout = ModelLayout(info.model, 1)
    check_compatible(info, layout)
    state = {"master": torch.zeros(layout.total, dtype=torch.float32)}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(info.path / OPTIM_DIR)), no_dist=True)
    except Exception as exc:  # noqa: BLE001
        raise HydraulisError(f"{info.path / OPTIM_DIR}: cannot read the master weights: {exc}") from None
    return info, state["master"]
