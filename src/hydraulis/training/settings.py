"""A run's settings: the one tree the ranks receive, made once by `job.prepare` before any rank starts (no torch).

`RunSettings` holds what every rank's trainer runs (`hydraulis.settings.TrainerSettings`: the model, the pool
and its cost model, the optimizer, `[train]`), the data it reads, the evaluation, what the command line asked
(`Invocation`) and the config's own text for the run directory. It is picklable: `spawn` sends it to every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hydraulis.data.sampler import Overlong, TokenBudgetSampler
from hydraulis.settings import TrainerSettings
from hydraulis.training.evaluation import EvalSet
from hydraulis.training.mixture import MixtureSpec

TRANSCRIPT = "train.log"  # RunSettings.transcript


@dataclass(frozen=True)
class DataSettings:
    """The training data: the corpus (or mixture), its tokenizer and the sampler that draws from it."""

    corpus_path: str
    tokenizer: str
    sampler: TokenBudgetSampler  # the training sampler (prepare builds and checks it once), at its start
    max_len: int
    mixture: MixtureSpec | None = None  # [data] corpus as a list: its sources (corpus_path then names them all)
    overlong: Overlong | None = None  # what max_len cuts of the corpus (records, target tokens)


@dataclass(frozen=True)
class Invocation:
    """What the command line asked of this run, beside the config."""

    out: str  # the run directory (--out, else [train] out), as given
    resume: bool = False
    resume_from: str | None = None  # the verified checkpoint rank 0 resumes from, picked before any rank starts
    stop_at: int | None = None  # --stop-at: end this invocation at that step; the schedule keeps its length
    change_config: bool = False  # --change-config: a resume on another corpus starts the data at its beginning
    max_restarts: int = 0


@dataclass(frozen=True)
class RunSettings:
    """Everything a rank needs, resolved and checked in the parent."""

    trainer: TrainerSettings
    data: DataSettings
    invocation: Invocation
    world: int
    config_toml: str  # the resolved config (paths absolute, --out and --steps in it): the run's config.toml
    eval: EvalSet | None = None  # [eval]: the held-out batches and their plans

    @property
    def steps(self) -> int:
        """The LR schedule's length."""
        return self.trainer.train.steps

    @property
    def end_step(self) -> int:
        """The step this invocation trains up to (exclusive)."""
        return self.invocation.stop_at or self.steps

    @property
    def out(self) -> Path:
        return Path(self.invocation.out)

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    @property
    def transcript(self) -> Path:
        """The run's log: every line the launcher and rank 0 print, whether or not a terminal shows them."""
        return self.out / TRANSCRIPT
