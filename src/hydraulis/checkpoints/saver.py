"""Saving and loading training state: the owner shards with torch.distributed.checkpoint (DCP).

The directory's names, manifest, discovery and retention are torch-free, in
manifest.py beside it; the RNG states are rng.py.

A checkpoint is a directory `step-000123` (the trainer step it resumes at):

    manifest.json       `hydraulis.checkpoint/1`: model, tokenizer, corpus checksums, world size,
                        step, sampler state, LR schedule inputs, pool, the online refit the run
                        plans with (cost/refit.py), and every file's size and sha256; written
                        last, so its presence marks a complete checkpoint
    optimizer/          DCP: `.metadata` and one `__R_0.distcp` per saving rank
    rng-00000.json ...  each rank's torch, numpy and python RNG states

Each rank writes only what it owns (runtime/optimizer/layout.py): its chunk of every stripe
of the fp32 master, exp_avg and exp_avg_sq, each chunk the local shard of
one 1-D DTensor per stripe (`master.00003`), sharded on dim 0 over all
ranks. The chunks are torch.chunk sizes, exactly DTensor's Shard(0), and the
stripes depend on the model alone, so DCP reshards on load: a job of another
world size (and so another pool) reads the intersections of its new chunks.

Atomic: ranks write into a hidden `.step-000123.tmp` next to the target,
rank 0 writes the manifest and renames the directory into place, and only
then deletes checkpoints beyond the last `keep`. A checkpoint without a
manifest, with a missing, truncated or corrupt file, or a temporary
directory is never loaded: `latest_checkpoint` skips every one that does
not verify completely, saying so in one line, and refuses when none does. Loading checks everything (schema,
model shape, corpus, files, checksums) on every rank before it changes
anything, and all ranks raise the same `HydraulisError`.

Checkpoint directories must be visible to every rank (one machine, or a
shared file system). DCP's `.metadata` is a pickle: its checksum is checked
before it is read, but load only checkpoints you trust.
"""

from __future__ import annotations

import datetime
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from hydraulis.checkpoints.manifest import (
    CHECKPOINT_SCHEMA,
    MANIFEST_FILE,
    OPTIM_DIR,
    OPTIM_KEYS,
    CheckpointInfo,
    FileEntry,
    check_files,
    check_visible,
    prune,
    read_manifest,
    resolve_checkpoint,
    rng_file,
    step_dir_name,
)
from hydraulis.checkpoints.rng import rng_state, set_rng_state
from hydraulis.errors import HydraulisError
from hydraulis.files import read_json_object, replace_directory, sha256_file, write_json_atomic
from hydraulis.progress import Log, aside
from hydraulis.settings import DEFAULT_KEEP

if TYPE_CHECKING:
    from hydraulis.cost.refit import RefitState
    from hydraulis.data.manifest import CorpusManifest
    from hydraulis.runtime.optimizer.layout import ShardLayout
    from hydraulis.runtime.optimizer.sharded import ShardedOptimizer
    from hydraulis.runtime.parallelism.launch import DistEnv
    from hydraulis.runtime.plan_feed import PlanFeed
    from hydraulis.runtime.trainer import Trainer
    from hydraulis.settings import TrainerSettings

T = TypeVar("T")


@dataclass(frozen=True)
class Saved:
    """The stateful parts a checkpoint saves and loads (the plan feed: the next step and its batch's position;
    the optimizer: the owned state), and what its manifest records of the run (as torchtitan's
    `CheckpointManager(states=...)`)."""

    feed: PlanFeed
    optimizer: ShardedOptimizer
    settings: TrainerSettings  # the model, the optimizer's and LR schedule's settings, seed, dtype and pool
    corpus: CorpusManifest | None  # the training corpus's (None: documents held in memory)
    env: DistEnv
    control: dist.ProcessGroup | None  # the CPU group the ranks agree on

    @classmethod
    def of(cls, trainer: Trainer) -> Saved:
        """A trainer's parts."""
        return cls(feed=trainer.feed, optimizer=trainer.optimizer, settings=trainer.settings,
                   corpus=trainer.source.corpus.manifest, env=trainer.env, control=trainer.control)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world(self) -> int:
        return self.env.world_size

    @property
    def layout(self) -> ShardLayout:
        return self.optimizer.layout

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this rank's training: the next step, the sampler's position there, the
        deployments that missed a batch (rank 0's), the LR schedule's inputs and the optimizer's owned state (its
        tensors live, not copied)."""
        return {**self.feed.state_dict(), "schedule": self.settings.lr_schedule_state(),
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict` (the schedule is this run's settings; the caller compares it)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.feed.load_state_dict(state)


def check_compatible(info: CheckpointInfo, layout: ShardLayout) -> None:
    """The checkpoint holds this model's global vector (manifest and DCP metadata agree with the layout)."""
    differ = info.model.tensor_differences(layout.spec)
    if differ:
        raise HydraulisError(
            f"{info.manifest_path}: checkpoint of model {info.model.describe()}, "
            f"this run's model is {layout.spec.describe()} ({differ[0]} differs)"
        )
    meta_path = info.path / OPTIM_DIR / ".metadata"
    try:
        import torch.distributed.checkpoint as dcp

        meta = dcp.FileSystemReader(str(info.path / OPTIM_DIR)).read_metadata()
        sizes = {k: tuple(v.size) for k, v in meta.state_dict_metadata.items()}
    except Exception as exc:  # noqa: BLE001 - a damaged file may fail in many ways inside DCP
        raise HydraulisError(f"{meta_path}: cannot read the DCP metadata: {type(exc).__name__}: {exc}") from None
    if "master" in sizes:
        raise HydraulisError(
            f"{meta_path}: saved in the unstriped layout of Hydraulis before 2026-12 (one 'master' vector); "
            "this version reads striped checkpoints only: train from the exported model with init_from"
        )
    for key in OPTIM_KEYS:
        for s in range(layout.stripes):
            want = (layout.stripe_length(s),)
            got = sizes.get(stripe_key(key, s))
            if got != want or info.parameters != layout.total:
                raise HydraulisError(
                    f"{meta_path}: {stripe_key(key, s)} has shape {got}, this model's stripe {s} has {want[0]} "
                    f"elements ({layout.total} in all)"
                )


# -- collectives ------------------------------------------------------------------------------------
def _agree(saved: Saved, fn: Callable[[], T]) -> T:
    """fn() on every rank; if any raised a HydraulisError, every rank raises the first one (none is left waiting)."""
    try:
        result, error = fn(), None
    except HydraulisError as exc:
        result, error = None, str(exc)
    errors = [error]
    if saved.world > 1:
        errors = [None] * saved.world
        dist.all_gather_object(errors, error, group=saved.control)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise HydraulisError(first)
    return result  # type: ignore[return-value]


def _gather(saved: Saved, obj: Any) -> list[Any]:
    if saved.world == 1:
        return [obj]
    out: list[Any] = [None] * saved.world
    dist.all_gather_object(out, obj, group=saved.control)
    return out


def _writer(name: str) -> int:
    """The rank that wrote a checkpoint file (`__R_0.distcp`, `rng-R.json`; rank 0 the rest): it hashes it."""
    m = re.fullmatch(r"(?:optimizer/__(\d+)_\d+\.distcp|rng-(\d+)\.json)", name)
    return int(m.group(1) or m.group(2)) if m else 0


def stripe_key(key: str, stripe: int) -> str:
    """The DCP name of one stripe of an owned tensor."""
    return f"{key}.{stripe:05d}"


def _sharded(saved: Saved, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Each owned tensor's chunk of every stripe as the local shard of that stripe's 1-D DTensor (views, no copy)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(saved.env.device.type, (saved.world,))
    layout, rank = saved.layout, saved.rank
    out = {}
    for k, t in tensors.items():
        for s in range(layout.stripes):
            lo, hi = int(layout.local_starts[s, rank]), int(layout.local_starts[s + 1, rank])
            shape = torch.Size([layout.stripe_length(s)])
            out[stripe_key(k, s)] = DTensor.from_local(t[lo:hi], mesh, [Shard(0)], run_check=False, shape=shape,
                                                       stride=(1,))
    return out


# -- save ----------------------------------------------------------------------------------------------
def _manifest(
    saved: Saved, state: dict[str, Any], files: dict[str, FileEntry], refit: RefitState | None
) -> dict[str, Any]:
    s = saved.settings
    corpus_manifest = saved.corpus
    corpus = None
    tokenizer = None
    if corpus_manifest is not None:
        tokenizer = corpus_manifest.tokenizer
        corpus = {"name": corpus_manifest.name, "sha256": dict(corpus_manifest.checksums)}
    return {
        "schema": CHECKPOINT_SCHEMA,
        "step": state["step"],
        "world_size": saved.world,
        "model": s.model.to_dict(),
        "parameters": saved.layout.total,
        "tokenizer": tokenizer,
        "corpus": corpus,
        "optimizer": {"step": state["optimizer"]["step"], "adamw": asdict(s.optim.adamw)},
        "sampler": state["sampler"].to_dict(),
        "schedule": state["schedule"],
        "seed": s.train.seed,
        "dtype": s.train.dtype,
        "pool": [{"text": str(d), "replicas": d.to_rows()} for d in s.parallel.pool],
        "missed": state["missed"],  # deployments that could not hold some batch of the run (rank 0's planner)
        "refit": None if refit is None else refit.to_json(),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "files": {k: asdict(v) for k, v in sorted(files.items())},
    }


def save_checkpoint(
    saved: Saved, out_dir: str | Path, keep: int = DEFAULT_KEEP, log: Log = aside, refit: RefitState | None = None
) -> Path:
    """Save the parts' state as out_dir/step-NNNNNN (every rank calls it); returns the directory.

    `refit`: rank 0's online refit (training/run_fidelity.py), which a resume plans with.

    Older checkpoints beyond the newest `keep` are deleted after the new one
    is complete (keep <= 0 keeps all).
    """
    import torch.distributed.checkpoint as dcp

    out = Path(out_dir)
    state = saved.state_dict()
    name = step_dir_name(state["step"])
    final, tmp = out / name, out / f".{name}.tmp"
    rank = saved.rank

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

    _agree(saved, prepare)
    sharded = _sharded(saved, {k: state["optimizer"][k] for k in OPTIM_KEYS})
    dcp.save(sharded, storage_writer=dcp.FileSystemWriter(str(tmp / OPTIM_DIR)), process_group=saved.control)
    write_json_atomic(tmp / rng_file(rank), rng_state(saved.env.device))
    _gather(saved, None)  # a barrier: every rank's files are written
    names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file() and not p.name.endswith(".tmp"))
    mine = {n: FileEntry((tmp / n).stat().st_size, sha256_file(tmp / n)) for n in names if _writer(n) == rank}
    files = {k: v for part in _gather(saved, mine) for k, v in part.items()}

    def publish() -> None:
        if rank != 0:
            return
        check_visible(tmp, files)  # every rank's shard, as its writer reported it, before the manifest exists
        try:
            write_json_atomic(tmp / MANIFEST_FILE, _manifest(saved, state, files, refit))  # last: marks it complete
            replace_directory(tmp, final)  # the same step saved again (e.g. right after a resume) replaces it
        except OSError as exc:
            raise HydraulisError(f"{final}: cannot publish the checkpoint: {exc.strerror or exc}") from None
        prune(out, keep, spare=final)

    _agree(saved, publish)
    return final


# -- load ----------------------------------------------------------------------------------------------
def load_checkpoint(
    saved: Saved, path: str | Path, verify: bool = True, log: Log = aside, new_corpus: bool = False
) -> CheckpointInfo:
    """Put a checkpoint's state into the saved parts (every rank calls it), whatever world size saved it.

    Everything is checked first (with `verify`, every file's checksum, the
    files spread over the ranks); only then are the optimizer, the step, the
    sampler and the RNGs replaced. The next `step()` trains exactly the batch
    an uninterrupted run would have trained next; with `new_corpus` (--change-config), one saved on another
    corpus goes on at this one's start (its sampler's position means nothing here)."""
    fresh_data = saved.feed.state_dict()["sampler"]  # where this corpus starts (before anything is loaded)
    def moved_from(info: CheckpointInfo) -> bool:  # saved on another corpus than this run's
        ours = saved.corpus
        return ours is not None and info.corpus_sha256 is not None and dict(ours.checksums) != info.corpus_sha256

    import torch.distributed.checkpoint as dcp

    path = Path(path)
    world, rank = saved.world, saved.rank

    def check() -> CheckpointInfo:
        info = read_manifest(path)
        check_files(info, hashes=False)
        check_files(info, [f"{OPTIM_DIR}/.metadata"])  # checked before DCP unpickles it
        check_compatible(info, saved.layout)
        if moved_from(info) and not new_corpus:
            raise HydraulisError(
                f"{info.manifest_path}: saved while training on another corpus (its checksums differ from "
                f"corpus {saved.corpus.name}'s manifest); add --change-config to continue it on this corpus"
            )
        sampler = saved.feed.sampler
        previous = sampler.state
        try:
            sampler.state = fresh_data if moved_from(info) else info.sampler  # the setter checks it
        except HydraulisError as exc:
            raise HydraulisError(f"{info.manifest_path}: {exc}") from None
        finally:
            sampler.state = previous
        if verify:
            check_files(info, sorted(info.files)[rank::world])  # every file once, the reading spread over ranks
        return info

    info = _agree(saved, check)
    moved = moved_from(info)
    if moved:
        log(f"--change-config: {path} was saved on another corpus; the data starts at this corpus's beginning, "
            f"the weights, optimizer and LR schedule continue at step {info.step}")
    current = saved.state_dict()
    fresh = {k: torch.zeros_like(current["optimizer"][k]) for k in OPTIM_KEYS}

    def read() -> None:
        try:
            dcp.load(
                _sharded(saved, fresh),
                storage_reader=dcp.FileSystemReader(str(path / OPTIM_DIR)),
                process_group=saved.control,
            )
        except Exception as exc:  # noqa: BLE001 - DCP wraps every rank's read error
            raise HydraulisError(f"{path / OPTIM_DIR}: cannot read the optimizer state: {exc}") from None
        own = path / rng_file(rank)
        source = own if own.name in info.files else path / rng_file(0)
        rng = read_json_object(source)
        set_rng_state(rng, saved.env.device, str(source))

    _agree(saved, read)
    saved.load_state_dict(
        {"step": info.step, "sampler": fresh_data if moved else info.sampler, "missed": info.missed,
         "optimizer": {**fresh, "step": info.optimizer_step}}
    )
    return info


def resume(
    saved: Saved, path: str | Path, verify: bool = True, log: Log = aside, chosen: str | None = None,
    new_corpus: bool = False,
) -> CheckpointInfo | None:
    """Load the checkpoint at `path` or the newest verifying one under it (every rank calls it).

    Rank 0 picks it (`chosen`, when the job picked it before the ranks
    started, else `resolve_checkpoint`) and tells the others; None when there
    is none. A checkpoint picked from a directory was verified whole while
    picking, so its checksums are not read again.
    """

    def pick() -> str | None:
        if saved.rank != 0:
            return None
        found = chosen or resolve_checkpoint(path, log=log)
        return None if found is None else str(found)

    picked = _gather(saved, _agree(saved, pick))[0]
    if picked is None:
        return None
    return load_checkpoint(saved, picked, verify and Path(picked) == Path(path), log, new_corpus)


# -- single-process reading (export) ------------------------------------------------------------------
def load_master(path: str | Path, verify: bool = True) -> tuple[CheckpointInfo, torch.Tensor]:
    """A checkpoint's whole fp32 master vector on one process, without torch.distributed."""
    import torch.distributed.checkpoint as dcp

    from hydraulis.runtime.optimizer.layout import ShardLayout

    info = read_manifest(path)
    check_files(info, hashes=False)
    check_files(info, hashes=verify)
    layout = ShardLayout(info.model, 1)
    check_compatible(info, layout)
    master = torch.zeros(layout.total, dtype=torch.float32)
    starts = layout.bounds[:, 0]
    state = {stripe_key("master", s): master[int(starts[s]) : int(starts[s]) + layout.stripe_length(s)]
             for s in range(layout.stripes)}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(info.path / OPTIM_DIR)), no_dist=True)
    except Exception as exc:  # noqa: BLE001
        raise HydraulisError(f"{info.path / OPTIM_DIR}: cannot read the master weights: {exc}") from None
    return info, master


@dataclass(frozen=True)
class CheckpointManager:
    """When a run saves and how many checkpoints it keeps: the loop asks it after every step.

    It saves the parts it is handed (`states`) every `every` steps (0: never), at `last_step` and when the ranks
    agreed to stop; it keeps the newest `keep` complete checkpoints.
    """

    states: Saved
    directory: Path
    every: int
    keep: int
    last_step: int
    log: Log = aside

    def resume(self, verify: bool = True, chosen: str | None = None, new_corpus: bool = False) -> CheckpointInfo | None:
        """The newest verifying checkpoint (or `chosen`) into the parts (every rank calls it); None without one."""
        return resume(self.states, self.directory, verify=verify, log=self.log, chosen=chosen, new_corpus=new_corpus)

    def due(self, step: int, stopping: bool = False) -> bool:
        return stopping or step == self.last_step or (self.every > 0 and step % self.every == 0)

    def maybe_save(self, stopping: bool = False, refit: RefitState | None = None) -> Path | None:
        """Save if one is due after the last step (every rank calls it); the directory, or None."""
        if not self.due(self.states.feed.step, stopping):
            return None
        path = save_checkpoint(self.states, self.directory, keep=self.keep, log=self.log, refit=refit)
        self.log(f"saved {path}")
        return path
