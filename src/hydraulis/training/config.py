"""The run config of `hydraulis train`: a TOML file, validated at the boundary by pydantic.

Every bad field gets one line naming its key (`data.tokens_per_batch`) and
what is allowed; unknown keys are refused, so a typo never silently falls
back to a default. `load_config` returns the validated model;
`training.job.prepare` resolves it, once, into the frozen `JobConfig` (training/job_config.py), and from
that the `RunSettings` the ranks take (training/settings.py: model spec, cost model, pool placed on the
world size), checking everything that can be checked before any rank starts.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from hydraulis.cost.context_parallel import CP_SUFFIX
from hydraulis.cost.profiled import PRESETS
from hydraulis.data.tokenizer import TOKENIZERS
from hydraulis.errors import HydraulisError
from hydraulis.files import read_text
from hydraulis.limits import (
    DEFAULT_EXCHANGE_BUCKET_BYTES,
    DEFAULT_MAX_POOL,
    DEFAULT_TIMEOUT_S,
    MAX_POOL,
    MAX_TIMEOUT_S,
    parse_size,
)
from hydraulis.optim import LR_SCHEDULES, AdamWSettings, OptimSettings
from hydraulis.settings import DEFAULT_KEEP
from hydraulis.specs import DTYPE_NAMES, MODELS, SHAPE_FIELDS, ModelSpec

MAX_TOKENS = 2**31 - 1


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """Strict numbers: `lr = "3e-3"` or `steps = true` is refused (pydantic would convert them); an int
        is still a float. Not pydantic's strict mode, which would also refuse TOML arrays for tuples."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _numeric(field.annotation):
            values = value if isinstance(value, list) else [value]
            bad = next((v for v in values if isinstance(v, str | bool)), None)
            if bad is not None:
                raise ValueError(f"expected a number, not a {type(bad).__name__}; write a bare number like 3e-3")
        return value


_PRESETS = "the preset's"  # what a shape key left unset means: the preset's value


class ModelSection(_Section):
    preset: str | None = "tiny"
    layers: int | None = Field(None, ge=1, le=4096, description=_PRESETS)
    hidden: int | None = Field(None, ge=1, le=1 << 17, description=_PRESETS)
    ffn: int | None = Field(None, ge=1, le=1 << 19, description=_PRESETS)
    heads: int | None = Field(None, ge=1, le=1024, description=_PRESETS)
    kv_heads: int | None = Field(None, ge=1, le=1024, description="the preset's, else heads")
    vocab: int | None = Field(None, ge=2, le=1 << 22, description=_PRESETS)
    # a Hugging Face model directory (families.py: llama, mistral, qwen2, qwen3)
    init_from: str | None = Field(None, description="random initial weights")

    @field_validator("preset")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        if v is not None and v not in MODELS:
            raise ValueError(f"unknown model preset {v!r}; known: {', '.join(MODELS)}")
        return v

    def spec(self) -> ModelSpec:
        shape = {k: getattr(self, k) for k in SHAPE_FIELDS}
        given = {k: v for k, v in shape.items() if v is not None}
        if self.preset is None and len(given) < 5:
            missing = [k for k, v in shape.items() if v is None and k != "kv_heads"]
            raise HydraulisError(f"model: without a preset, give {', '.join(missing)}")
        base = MODELS[self.preset] if self.preset else None
        values = {k: given.get(k, getattr(base, k) if base else None) for k in shape}
        if values["kv_heads"] is None:
            values["kv_heads"] = values["heads"]
        name = self.preset if base and not given else "custom"
        return ModelSpec(name=name, **values)


class DataSection(_Section):
    # One corpus, or a mixture: several, each drawn at its weight's share of the tokens (weights normalised).
    corpus: str | list[str] = "python-stdlib"
    weights: list[float] | None = Field(None, description="one corpus")
    tokenizer: str = Field("auto", min_length=1)  # auto, gpt2, bytes, or a Hugging Face tokenizer path
    tokens_per_batch: int = Field(16384, ge=1, le=MAX_TOKENS)
    max_len: int = Field(2048, ge=2, le=MAX_TOKENS)
    overlong: Literal["split", "truncate", "drop"] = "split"
    seed: int = Field(1, ge=0, le=2**32 - 1)
    # Processes that tokenize a source or built-in corpus built into the cache (data build's --workers).
    build_workers: int | None = Field(None, ge=1, le=4096, description="the cores available")

    @model_validator(mode="after")
    def _fits(self) -> DataSection:
        self._check_mixture()
        if self.max_len > self.tokens_per_batch:
            raise ValueError(
                f"max_len {self.max_len} is above tokens_per_batch {self.tokens_per_batch}: "
                "a sequence could never fit in a batch"
            )
        return self

    def _check_mixture(self) -> None:
        if isinstance(self.corpus, str):
            if self.weights is not None:
                raise ValueError("weights are for a mixture: give corpus as a list, one weight per corpus")
            return
        if not self.corpus or len(set(self.corpus)) != len(self.corpus):
            raise ValueError(f"a mixture needs one or more different corpora, got {self.corpus}")
        if self.weights is None or len(self.weights) != len(self.corpus):
            raise ValueError(f"give data.weights, one per corpus of data.corpus ({len(self.corpus)}), "
                             f"got {self.weights}")  # fmt: skip
        if any(not 0 < w < float("inf") for w in self.weights):
            raise ValueError(f"data.weights must be positive numbers, got {self.weights}")

    @property
    def corpora(self) -> list[str]:
        """The corpus, or the mixture's corpora."""
        return [self.corpus] if isinstance(self.corpus, str) else list(self.corpus)


class ParallelSection(_Section):
    pool: str = "auto"  # "auto", a hydraulis.pool/1 file, or deployments separated by ';'
    profile: str = "tiny@cpu"  # a profile file, a preset, MODEL@DEVICE (analytic), or @DEVICE (this model, analytic)
    # profile = "auto": reuse a quiet profile another run measured on this machine ($HYDRAULIS_CACHE/profiles) and
    # keep a quiet one measured here for later runs; false: measure for this run, read and write no cache.
    profile_cache: bool = True
    gpus_per_node: int | None = Field(
        None, ge=1, le=1024, description="torchrun's LOCAL_WORLD_SIZE, else the world size (one node)"
    )
    sequence_parallel: bool = False
    recompute: bool | list[str] = False  # true: every config; or the configs that recompute, e.g. ["tp1pp1"]
    # The planner chooses a memory policy per micro-batch (none, selective, full recompute: the lightest whose cap
    # holds it); false: every micro-batch of a config runs its one policy (full in `recompute`, else none).
    memory_policies: bool = False
    max_pool: int = Field(DEFAULT_MAX_POOL, ge=1, le=MAX_POOL)
    # pool = "auto" weighs interleaved 1F1B too (`hydraulis propose --interleave`): each config above pp 2 at its
    # deepest vp, one layer a chunk (`ParallelConfig.planned_vp_choices`); false: plain 1F1B only.
    interleave: bool = True
    # Each replica's weight gradients wait for the gaps of its pipeline where that simulates faster (zero-bubble:
    # planner/oracles/deferral.py plans the slots, runtime/parallelism/weight_grad.py runs them); false: fused backward.
    zero_bubble: bool = False
    # The optimizer's gather and reduce run in rounds, two in flight, each with a send and a receive buffer of
    # at most half this many MiB (runtime/optimizer/exchange_plan.py): two buckets in all.
    exchange_bucket_mb: float = Field(DEFAULT_EXCHANGE_BUCKET_BYTES / (1 << 20), gt=0)
    # Gather a layer's parameters while the one before it computes, send gradients while backward goes on
    # (runtime/optimizer/exchange.py); false: the whole gather before compute and the whole reduce after it.
    overlap_exchange: bool = True
    # What one rank's tensors may hold at their peak ("96MiB", "70GB"): the planner's caps use it in place of
    # the device's memory, every rank's measured peak is checked against it, and CUDA limits itself to it.
    memory_per_rank: str | int | None = Field(None, description="the device's own memory")

    @field_validator("memory_per_rank", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        if v is not None:
            try:
                parse_size(v, "")
            except HydraulisError:
                raise ValueError(
                    'expected a size: bytes, or a number and a unit like "96MiB" or "70GB", between 1 byte and 1 PiB'
                ) from None
        return v

    def analytic(self) -> bool:
        """Whether `profile` names the analytic model (`MODEL@DEVICE`, `@DEVICE`), not measured times."""
        from hydraulis.cost import PRESETS

        name = self.profile.removesuffix("+cp")
        return "@" in name and name not in PRESETS and not name.endswith(".json") and not Path(name).is_file()

    @field_validator("recompute")
    @classmethod
    def _configs(cls, v: bool | list[str]) -> bool | list[str]:
        if isinstance(v, list):
            from hydraulis.parallel import ParallelConfig

            for text in v:
                try:
                    ParallelConfig.parse(text)
                except HydraulisError as exc:
                    raise ValueError(str(exc)) from None
        return v


_OPTIM, _ADAMW = OptimSettings(), AdamWSettings()  # the defaults, written once in optim.py


class OptimSection(_Section):
    lr: float = Field(_OPTIM.lr, gt=0, le=10)
    warmup: int = Field(_OPTIM.warmup, ge=0)
    schedule: Literal[LR_SCHEDULES] = _OPTIM.schedule  # type: ignore[valid-type]
    min_lr_ratio: float = Field(_OPTIM.min_lr_ratio, ge=0, le=1)
    weight_decay: float = Field(_ADAMW.weight_decay, ge=0, le=10)
    grad_clip: float = Field(_ADAMW.grad_clip, ge=0)
    betas: tuple[float, float] = _ADAMW.betas
    eps: float = Field(_ADAMW.eps, gt=0, le=1)

    def settings(self) -> OptimSettings:
        """The optimizer's settings record, built from this section."""
        adamw = AdamWSettings(tuple(self.betas), self.eps, self.weight_decay, self.grad_clip)
        return OptimSettings(self.lr, self.warmup, self.schedule, self.min_lr_ratio, adamw)

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"each beta must lie in [0, 1), got {list(v)}")
        return v


class TrainSection(_Section):
    steps: int = Field(100, ge=1, le=10**9)
    dtype: Literal[DTYPE_NAMES] = DTYPE_NAMES[0]  # type: ignore[valid-type]
    reduce_dtype: Literal[DTYPE_NAMES] = DTYPE_NAMES[0]  # type: ignore[valid-type]
    # Process-group timeout in seconds once the first step is done (which gets 3x: runtime/parallelism/timeouts.py).
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every: int = Field(1, ge=1)
    out: str = "runs/demo"
    checkpoint_every: int = Field(0, ge=0)
    keep_checkpoints: int = Field(DEFAULT_KEEP, ge=1, le=1000)
    max_bad_steps: int = Field(3, ge=1, le=10**6)  # steps with a non-finite loss or grad norm before the run stops
    # After training, the last compare_steps batches again on each homogeneous deployment of the pool
    # and as planned, compare_repeats times interleaved: the measured speedup beside the predicted one.
    compare_steps: int = Field(0, ge=0, le=10_000)
    compare_repeats: int = Field(3, ge=1, le=100)


class EvalSection(_Section):
    """Held-out loss: a share of the corpus's documents that training never samples, or a corpus of its own."""

    holdout: float = Field(0.0, ge=0.0, lt=1.0)  # each document held out with this probability (by [data] seed)
    corpus: str | None = Field(None, description="no eval corpus")  # instead: one of its own, as [data] corpus
    every: int = Field(0, ge=0, le=MAX_TOKENS)  # evaluate after every this many steps (0: only at the end)
    tokens: int = Field(65536, ge=1, le=MAX_TOKENS)  # how many held-out tokens one evaluation reads, at most

    @model_validator(mode="after")
    def _one_source(self) -> EvalSection:
        if self.corpus is not None and self.holdout > 0:
            raise ValueError("give holdout or corpus, not both: the held-out data comes from one of them")
        return self


class RunConfig(_Section):
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    parallel: ParallelSection = ParallelSection()
    optim: OptimSection = OptimSection()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()

    def resolved_values(self, out: str | None = None, steps: int | None = None) -> dict[str, dict[str, Any]]:
        """Every key's value (defaults included), with the command line's run directory (`out`, absolute) and
        `steps` in them, and every path that names an existing file or directory absolute (from the current
        directory, as it was read): what `config.toml` records (`toml_text`) and what the job's records hold
        (training/job_config.py), so that an export or a rerun finds them from anywhere. Names (a built-in
        corpus, tokenizer, preset) and paths that are not there stay as given (the checks name the path they
        tried)."""
        def absolute(value: str | None, names: tuple[str, ...] = (), suffix: str = "") -> str | None:
            if value is None or value in ("auto", *names):
                return value
            base = value[: -len(suffix)] if suffix and value.endswith(suffix) else value
            return os.path.abspath(base) + value[len(base) :] if Path(base).exists() else value

        values = self.model_dump()
        data, parallel = values["data"], values["parallel"]
        corpora = [absolute(c) for c in self.data.corpora]
        values["model"]["init_from"] = absolute(self.model.init_from)
        data["corpus"] = corpora[0] if isinstance(self.data.corpus, str) else corpora
        data["tokenizer"] = absolute(self.data.tokenizer, TOKENIZERS)
        parallel["pool"] = absolute(self.parallel.pool)
        parallel["profile"] = absolute(self.parallel.profile, tuple(PRESETS), CP_SUFFIX)
        values["train"]["out"] = os.path.abspath(out or self.train.out)
        values["train"]["steps"] = self.train.steps if steps is None else steps
        return values

    def to_toml(self) -> str:
        """The config as TOML, every key as given or defaulted (`toml_text`)."""
        return toml_text(self.model_dump())


def toml_text(values: dict[str, dict[str, Any]]) -> str:
    """A config's values (`RunConfig.resolved_values`) as TOML, every key, defaults included, so a run can be
    repeated from it.

    TOML has no null: a key left unset is a comment saying what unset means (`# gpus_per_node: unset,
    ...`), so the file reads back to the same config."""
    lines = []
    for section, keys in values.items():
        lines.append(f"[{section}]")
        for key, value in keys.items():
            shown = f"# {key}: {unset(section, key)}" if value is None else f"{key} = {_toml_value(value)}"
            lines.append(shown)
        lines.append("")
    return "\n".join(lines)


def start_notes(config: RunConfig, steps: int) -> list[str]:
    """The lines a run prints at its start where a default (or a value it did not expect) matters."""
    notes = []
    parallel, optim = config.parallel, config.optim
    if parallel.analytic():
        given = "" if "profile" in parallel.model_fields_set else " (the default)"
        notes.append(
            f'note: [parallel] profile = "{parallel.profile}"{given} is the analytic model, not measured on this '
            'machine, so predicted times may be far off; profile = "auto" measures this model here first'
        )
    if optim.warmup > steps:
        last = optim.settings().lr_at(steps - 1, steps)
        notes.append(
            f"warning: [optim] warmup = {optim.warmup} is longer than the run's {steps} steps: the LR only rises "
            f"(to {last:.3g} at the last step, of lr {optim.lr:g}) and the schedule never starts"
        )
    return notes


def unset(section: str, key: str) -> str:
    """What a key left unset (None) means, from its field's description: docs/reference.md and config.toml say it."""
    field = RunConfig.model_fields[section].annotation.model_fields[key]
    return f"unset, {field.description}" if field.description else "unset"


def default_text(section: str, key: str) -> str:
    """A key's default as docs/reference.md gives it: its TOML value, or what unset means."""
    default = RunConfig.model_fields[section].annotation.model_fields[key].default
    return unset(section, key) if default is None else _toml_value(default)


def _numeric(annotation: Any) -> bool:
    """A field of numbers: int, float, an optional one, or a tuple of them."""
    import types
    import typing

    if annotation in (int, float):
        return True
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return all(a is type(None) or _numeric(a) for a in args) and any(a is not type(None) for a in args)
    return origin in (tuple, list) and bool(args) and all(a in (int, float) for a in args)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def first_error(exc: ValidationError, where: str) -> str:
    """One line for a pydantic error: the key path, what was given, what is allowed."""
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "(top level)"
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        section = key.rsplit(".", 1)[0] if "." in key else None
        allowed = RunConfig.model_fields if section is None else RunConfig.model_fields[section].annotation.model_fields
        return f"{where}: unknown key {key!r}; allowed: {', '.join(allowed)}"
    given = err.get("input")
    shown = "" if isinstance(given, dict) or given is None else f" (got {given!r})"
    return f"{where}: {key}: {message}{shown}"


def parse_config(data: dict[str, Any], where: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise HydraulisError(first_error(exc, where)) from None


def naming_file(message: str, path: str | Path) -> str:
    """A message that starts with a config key (`parallel.pool: ...`), with the config file named before it."""
    section = message.split(".", 1)[0]
    return f"{path}: {message}" if section in RunConfig.model_fields and "." in message else message


def load_config(path: str | Path) -> RunConfig:
    path = Path(path)
    text = read_text(path, missing="no such config file")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise HydraulisError(f"{path}: not valid TOML ({exc})") from None
    return parse_config(data, str(path))
