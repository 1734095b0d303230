"""Checkpoint scenarios that the multi-process tests run on every gloo rank (importable by spawned children)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from train_workers import cpu_settings, zero_bubble

from hydraulis.checkpoints.saver import Saved, load_checkpoint, resume, save_checkpoint
from hydraulis.data.build.corpus import build_corpus
from hydraulis.data.indexed import open_corpus
from hydraulis.data.sampler import SamplerState, TokenBudgetSampler
from hydraulis.errors import HydraulisError
from hydraulis.optim import AdamWSettings, OptimSettings
from hydraulis.runtime.parallelism.launch import init_distributed
from hydraulis.runtime.storage.hf_io import init_from
from hydraulis.runtime.trainer import Trainer
from hydraulis.settings import TrainerSettings

SEED = 7
STEPS = 6
SAVE_AT = 3  # the interrupted run stops after this many steps
KEEP = 2
POOL_4 = ("1x(tp2,pp1) + 2x(tp1,pp1)", "2x(tp1,pp2)", "1x(tp2,pp2)")
POOL_2 = ("1x(tp2,pp1)", "2x(tp1,pp1)")
# One pipeline pool without and with interleaving: the planner gives both the same micro-batches, and an interleaved
# step computes the same bits as a plain one, so a checkpoint of either resumes on the other bit for bit.
POOL_V1, POOL_V2 = ("2x(tp1,pp2)",), ("2x(tp1,pp2,vp2)",)
TOKENS_PER_BATCH = 700
MAX_LEN = 160


def make_corpus(path: Path, seed: int = SEED, documents: int = 48) -> Path:
    """A small byte-tokenized corpus with a real manifest (so checkpoints record its checksums)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz .,\n"))
    texts = ["".join(rng.choice(letters, size=int(n))) for n in rng.integers(4, 120, size=documents)]
    build_corpus(texts, path, "bytes", source="ckpt-test")
    return path


def settings(world: int, pool: tuple[str, ...], model: str = "tiny") -> TrainerSettings:
    optim = OptimSettings(lr=3e-3, warmup=2, schedule="cosine", adamw=AdamWSettings(weight_decay=0.1, grad_clip=0.5))
    return cpu_settings(world, pool, optim, STEPS, model, seed=SEED)


def make_trainer(
    world: int, pool: tuple[str, ...], corpus_dir: Path, model: str = "tiny", deferred: str | None = None
) -> Trainer:
    """`deferred`: every step's weight gradients wait, placed by that pattern (train_workers.weight_slots)."""
    env = init_distributed("cpu")
    corpus = open_corpus(corpus_dir)
    sampler = TokenBudgetSampler(corpus.lengths, TOKENS_PER_BATCH, max_len=MAX_LEN, seed=SEED)
    return Trainer(settings=settings(world, pool, model), corpus=corpus, sampler=sampler, env=env,
                   weight_slots=None if deferred is None else zero_bubble(deferred))


def first_run(rank: int, world: int, corpus_dir: Path, ckpt: Path, other: Path, interleaved: Path) -> dict:
    """An uninterrupted run of STEPS, then a run that saves after each of its SAVE_AT steps (keeping KEEP); then
    `interleaving_runs`."""
    t = make_trainer(world, POOL_4, corpus_dir)
    full = [t.step() for _ in range(STEPS)]
    t.close()
    part = make_trainer(world, POOL_4, corpus_dir)
    first = []
    for i in range(SAVE_AT):
        first.append(part.step())
        if i == SAVE_AT - 1:
            seed_rngs(100 + rank)  # each rank's own RNG states, which the resumed run must get back
        # the next batch is already drawn: the lookahead must not count
        save_checkpoint(Saved.of(part), ckpt, keep=KEEP)
    after_save = draw_rngs()
    part.close()
    mha = make_trainer(world, POOL_4, corpus_dir, model="tiny-mha")  # another shape (kv_heads 4, not 2)
    save_checkpoint(Saved.of(mha), other)
    mha.close()
    return {
        **interleaving_runs(world, corpus_dir, interleaved),
        "full": [m.loss for m in full],
        "full_positions": [(m.epoch, m.position) for m in full],
        "first": [m.loss for m in first],
        "master": t.optimizer.master.clone(),
        "exp_avg": t.optimizer.exp_avg.clone(),
        "rng": after_save,
    }


def interleaving_runs(world: int, corpus_dir: Path, out: Path) -> dict:
    """An uninterrupted run of STEPS on POOL_V1; runs of SAVE_AT steps on POOL_V1 and POOL_V2, each saved (to
    out / "v1" and out / "v2") for `resume_interleaving`."""
    t = make_trainer(world, POOL_V1, corpus_dir)
    full = [t.step().loss for _ in range(STEPS)]
    t.close()
    for name, pool in (("v1", POOL_V1), ("v2", POOL_V2)):
        part = make_trainer(world, pool, corpus_dir)
        for _ in range(SAVE_AT):
            part.step()
        save_checkpoint(Saved.of(part), out / name)
        part.close()
    return {"full_v1": full, "master_v1": t.optimizer.master.clone()}


def resume_interleaving(world: int, corpus_dir: Path, saved: Path) -> dict:
    """The POOL_V1 checkpoint resumed on POOL_V2 and the POOL_V2 one on POOL_V1: each run's losses and master.
    Both resumed runs defer their weight gradients (zero-bubble W's): on POOL_V2 each right before the stage's next
    forward, on POOL_V1 (vp = 1, through the lockstep executor) all at the stage's end."""
    out = {}
    for name, pool, deferred in (("v1", POOL_V2, "before-forward"), ("v2", POOL_V1, "end")):
        t = make_trainer(world, pool, corpus_dir, deferred=deferred)
        resume(Saved.of(t), saved / name)
        out[f"from_{name}"] = ([t.step().loss for _ in range(STEPS - SAVE_AT)], t.optimizer.master.clone())
        t.close()
    return out


def seed_rngs(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def draw_rngs() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random()


def _error(fn) -> str | None:
    try:
        fn()
    except HydraulisError as exc:
        return str(exc)
    return None


def resume_same(
    rank: int, world: int, corpus_dir: Path, bad: dict[str, Path], good: Path, fallback: Path, interleaved: Path
) -> dict:
    """In new processes: refused loads leave the trainer as it was; a damaged newest falls back; then resume; then
    `resume_interleaving`."""
    interleaving = resume_interleaving(world, corpus_dir, interleaved)
    t = make_trainer(world, POOL_4, corpus_dir)
    errors = {name: _error(lambda p=p: load_checkpoint(Saved.of(t), p)) for name, p in bad.items()}
    opt = t.optimizer
    untouched = (
        t.step_index == 0
        and opt.step_count == 0
        and float(opt.exp_avg.abs().sum()) == 0
        and bool(torch.equal(opt.master, t.optimizer.layout.init_owned(opt.rank, SEED)))
        and t.source.sampler.state == SamplerState()
    )
    fell_back = resume(Saved.of(t), fallback)
    info = resume(Saved.of(t), good)
    rng = draw_rngs()
    losses = [t.step() for _ in range(STEPS - SAVE_AT)]
    t.close()
    return {
        **interleaving,
        "errors": errors,
        "untouched": untouched,
        "fallback_step": None if fell_back is None else fell_back.step,
        "step": info.step,
        "saved_world": info.world_size,
        "rng": rng,
        "losses": [m.loss for m in losses],
        "positions": [(m.epoch, m.position) for m in losses],
        "master": t.optimizer.master.clone(),
        "exp_avg": t.optimizer.exp_avg.clone(),
    }


def resume_resharded_and_hf(rank: int, world: int, corpus_dir: Path, ckpt: Path, hf_dir: Path, hf_ckpt: Path) -> dict:
    """On 2 ranks and another pool: resume the 4-rank checkpoint; then train from an HF model and save."""
    t = make_trainer(world, POOL_2, corpus_dir)
    info = resume(Saved.of(t), ckpt)
    losses = [t.step() for _ in range(STEPS - SAVE_AT)]
    t.close()
    h = make_trainer(world, POOL_2, corpus_dir)
    init_from(h.optimizer, hf_dir)
    initial = h.optimizer.master.clone()
    hf_losses = [h.step() for _ in range(3)]
    save_checkpoint(Saved.of(h), hf_ckpt)
    saved = save_checkpoint(Saved.of(h), hf_ckpt)  # the same step again replaces it
    h.close()
    return {
        "step": info.step,
        "losses": [m.loss for m in losses],
        "master": t.optimizer.master.clone(),
        "hf_initial": initial,
        "hf_losses": [m.loss for m in hf_losses],
        "hf_master": h.optimizer.master.clone(),
        "hf_saved": str(saved),
    }
