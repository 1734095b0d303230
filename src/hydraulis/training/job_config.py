"""The validated config, resolved once before any rank starts: one frozen tree of its values (no torch).

`job.prepare` builds `JobConfig` first, the only reading of the pydantic `RunConfig` after `load_config`:
`RunConfig.resolved_values` puts the command line's `--out` and `--steps` in and makes every path found
absolute, and `config.toml`'s text is written from those same values. Every helper of the job (job_cost.py,
auto_profile.py, evaluation.py, mixture.py, job.py) takes these records, or the few values it needs; their
fields keep the config's key names, which the messages name. The ranks get what the job derives from them
(training/settings.py's `RunSettings`), `[optim]` and `[train]` as they are here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hydraulis.errors import HydraulisError
from hydraulis.limits import parse_size
from hydraulis.optim import OptimSettings
from hydraulis.parallel import ParallelConfig
from hydraulis.settings import TrainSettings
from hydraulis.specs import ModelSpec
from hydraulis.training.config import ModelSection


@dataclass(frozen=True)
class ModelChoice:
    """`[model]`: the shape its keys give, and the Hugging Face directory the model may start from."""

    shape: ModelSpec | None  # the preset and the keys given; None with init_from and no shape key (its own shape)
    init_from: str | None  # absolute when found
    given: tuple[str, ...] = ()  # the shape keys set beside init_from: each must agree with the directory's


@dataclass(frozen=True)
class DataChoice:
    """`[data]`, resolved: paths found absolute, a mixture's lists as tuples."""

    corpus: str | tuple[str, ...]
    weights: tuple[float, ...] | None
    tokenizer: str
    tokens_per_batch: int
    max_len: int
    overlong: str
    seed: int
    build_workers: int | None

    @classmethod
    def of(cls, data: dict[str, Any]) -> DataChoice:
        """`[data]`'s values (`RunConfig.resolved_values`) as a record."""
        return cls(**{**data, "corpus": _tuple(data["corpus"]), "weights": _tuple(data["weights"])})

    def tokenizer_for(self, spec: ModelSpec, init_from: str | None = None) -> str:
        """As given; `auto`: the init_from checkpoint's own tokenizer when it ships one, else GPT-2 when
        the vocabulary holds it, else bytes (the tiny models' 512 entries)."""
        if self.tokenizer != "auto":
            return self.tokenizer
        if init_from is not None and (Path(init_from) / "tokenizer.json").is_file():
            return init_from
        return "gpt2" if spec.vocab >= 50257 else "bytes"


@dataclass(frozen=True)
class ParallelChoice:
    """`[parallel]`, resolved: the pool and profile (paths absolute) and how the job's cost model is made."""

    pool: str
    profile: str
    profile_cache: bool
    gpus_per_node: int | None
    sequence_parallel: bool
    recompute: bool | tuple[str, ...]
    memory_policies: bool
    max_pool: int
    interleave: bool
    zero_bubble: bool
    exchange_bucket_mb: float
    overlap_exchange: bool
    memory_per_rank: str | int | None  # as the config wrote it (messages name it)
    budget_bytes: int | None  # memory_per_rank in bytes, or None for the device's own memory

    @classmethod
    def of(cls, parallel: dict[str, Any]) -> ParallelChoice:
        """`[parallel]`'s values (`RunConfig.resolved_values`) as a record, the budget in bytes."""
        memory = parallel["memory_per_rank"]
        budget = None if memory is None else parse_size(memory, "parallel.memory_per_rank")
        return cls(**{**parallel, "recompute": _tuple(parallel["recompute"]), "budget_bytes": budget})

    def recompute_configs(self, configs) -> frozenset:
        """The configs (of those given) whose replicas recompute activations."""
        if isinstance(self.recompute, bool):
            return frozenset(configs) if self.recompute else frozenset()
        named = {ParallelConfig.parse(t) for t in self.recompute}
        unknown = named - set(configs)
        if unknown:
            raise HydraulisError(
                f"parallel.recompute: {', '.join(sorted(g.name for g in unknown))} is not a config of the profile"
            )
        return frozenset(named)


@dataclass(frozen=True)
class EvalChoice:
    """`[eval]`: a held-out share of the corpus, or a corpus of its own (path absolute when found)."""

    holdout: float
    corpus: str | None
    every: int
    tokens: int

    @property
    def enabled(self) -> bool:
        return self.corpus is not None or self.holdout > 0


@dataclass(frozen=True)
class JobConfig:
    """The whole config, resolved: one record per section, the run directory and config.toml's text."""

    model: ModelChoice
    data: DataChoice
    parallel: ParallelChoice
    optim: OptimSettings
    train: TrainSettings  # [train] with --steps, the data seed and init_from: what every rank's trainer runs
    eval: EvalChoice
    run_dir: Path  # --out, else [train] out, as given (config.toml records it absolute)
    toml: str  # the resolved config as TOML: the run's config.toml


def model_choice(section: ModelSection, init_from: str | None) -> ModelChoice:
    """`[model]` with its init_from as resolved: the keys' shape when it matters (it fails here when the keys
    cannot make one), and which shape keys were given beside init_from."""
    given = tuple(sorted(section.model_fields_set - {"init_from"}))
    return ModelChoice(shape=section.spec() if init_from is None or given else None, init_from=init_from, given=given)


def train_settings(values: dict[str, dict[str, Any]]) -> TrainSettings:
    """`[train]` as every rank's trainer runs it (steps with --steps in them), with the data seed and init_from."""
    train = values["train"]
    keys = {f.name for f in fields(TrainSettings)} & set(train)
    return TrainSettings(**{k: train[k] for k in keys}, seed=values["data"]["seed"],
                         init_from=values["model"]["init_from"])


def check_corpus_names(values: dict[str, dict[str, Any]]) -> None:
    """Every corpus the config names ([data] corpus, [eval] corpus), before any is built."""
    from hydraulis.data.builtin import check_corpus_name

    corpus, other = values["data"]["corpus"], values["eval"]["corpus"]
    for name in [corpus] if isinstance(corpus, str) else corpus:
        check_corpus_name(name, "data.corpus")
    if other is not None:
        check_corpus_name(other, "eval.corpus")


def _tuple(value):
    """A TOML list as a tuple (a frozen record's); anything else as it is."""
    return tuple(value) if isinstance(value, list) else value
