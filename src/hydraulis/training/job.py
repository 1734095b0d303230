"""A training job, resolved and checked before any rank starts (no torch).

`prepare` does everything that can fail on bad input BEFORE any rank starts
or any file is written: it reads the validated config once, into the frozen
`JobConfig` (job_config.py) every step below takes, opens (or builds) the
corpus, loads the cost model (measuring it first with `profile = "auto"`,
auto_profile.py), places or proposes the pool for the world size, and
checks that the model fits some config of the pool at max_len. The
`RunSettings` it returns (training/settings.py), every default and derived value
resolved in it, is all that every rank of loop.py receives.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from hydraulis.checkpoints.manifest import sweep_temporary
from hydraulis.checkpoints.resume import check_config_change, check_stop_at, resume_point
from hydraulis.cost import CostModel
from hydraulis.data.indexed import IndexedCorpus, check_targets_left, overlong
from hydraulis.data.sampler import Overlong, TokenBudgetSampler
from hydraulis.errors import CrowdedError, HydraulisError, OverlongError
from hydraulis.files import write_json_atomic
from hydraulis.optim import OptimSettings
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.pool import PoolSetting, check_job_pool, parse_pool
from hydraulis.processes import interrupt
from hydraulis.progress import Log, say
from hydraulis.settings import ParallelSettings, TrainerSettings, TrainSettings
from hydraulis.specs import ClusterSpec, ModelSpec
from hydraulis.training.auto_profile import AUTO_PROFILE, REFIT_PROFILE, start_lines
from hydraulis.training.config import RunConfig, toml_text
from hydraulis.training.evaluation import EvalSet, eval_set, run_sampler
from hydraulis.training.job_config import (
    DataChoice,
    EvalChoice,
    JobConfig,
    ModelChoice,
    ParallelChoice,
    check_corpus_names,
    model_choice,
    train_settings,
)
from hydraulis.training.job_cost import auto_cost, check_budget, for_job, job_cost_model
from hydraulis.training.mixture import training_corpus
from hydraulis.training.settings import TRANSCRIPT, DataSettings, Invocation, RunSettings

RUN_FILES = ("metrics.jsonl", "config.toml", "pool.json", "summary.json", "report.png", "tb", AUTO_PROFILE,
             REFIT_PROFILE)


def torchrun_world() -> int | None:
    """The world size torchrun gives this process, or None when it runs alone."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def prepare(
    config: RunConfig, nproc: int | None, out: str | None, steps: int | None, resume: bool, max_restarts: int = 0,
    log: Log = say, stop_at: int | None = None, change_schedule: bool = False, change_config: bool = False,
) -> RunSettings:
    """The run's settings, every default and derived value resolved, checked (`max_restarts` >= 0: the command
    checks it); raises HydraulisError (one line) on any bad input, having written nothing."""
    values = config.resolved_values(out, steps)  # --out, --steps, paths absolute: what config.toml records
    check_corpus_names(values)  # every one, before any is built
    job = JobConfig(  # the one reading of the config: every part below reads this frozen tree
        model=model_choice(config.model, values["model"]["init_from"]), data=DataChoice.of(values["data"]),
        parallel=ParallelChoice.of(values["parallel"]), optim=config.optim.settings(), train=train_settings(values),
        eval=EvalChoice(**values["eval"]), run_dir=Path(out or config.train.out), toml=toml_text(values),
    )
    run_dir, steps, data, parallel = job.run_dir, job.train.steps, job.data, job.parallel
    # torchrun restarts every worker with the same arguments after a failure: continue, don't start over.
    resume = resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    spec = model_spec(job.model, data.max_len)
    setting = PoolSetting.parse(parallel.pool)
    auto_profile = parallel.profile == "auto"  # measured below, once the world size and the pool are known
    cost = None if auto_profile else for_job(job_cost_model(parallel.profile, spec), parallel, job.train.dtype)
    tokenizer = data.tokenizer_for(spec, job.model.init_from)
    token_ids = check_tokenizer(tokenizer, spec, job.model.init_from)  # a bad one fails before anything runs
    env_world = torchrun_world()
    resume_from = None
    if env_world is None or int(os.environ["RANK"]) == 0:  # under torchrun rank 0 writes the run directory
        resume_from = _check_run_dir(job, resume=resume, stop_at=stop_at, log=log,
                                     changes=(change_schedule, change_config))
    check_stop_at(stop_at, steps, 0)
    invocation = Invocation(out=str(run_dir), resume=resume, resume_from=resume_from, stop_at=stop_at,
                            change_config=change_config, max_restarts=max_restarts)
    world = _world(nproc, env_world, setting.gpus())
    gpn = parallel.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cluster = ClusterSpec(world, min(gpn, world))
    # The model against every config the pool may use, before any corpus build, profile or rank.
    configs = _pool_configs(setting, spec, world)
    configs = check_budget(cost, parallel, spec=spec, configs=configs, world=world, dtype=job.train.dtype,
                           max_len=data.max_len)
    # Vocabulary padding for every TP degree the pool has (with pool = "auto": may have).
    proposable = cost.configs if cost is not None and setting.auto else ()
    spec = _padded(spec, {g.tp for g in (*configs, *proposable)}, _resumed_checkpoint(run_dir, resume, resume_from))
    named = functools.partial(_corpus, tokenizer, token_ids, log, data.build_workers)  # (name, key): a corpus
    corpus, mixture = training_corpus(data, named)
    sampler, overlong = data_sampler(corpus, data, job.eval.holdout, log)
    data_settings = DataSettings(corpus_path=str(corpus.path), tokenizer=tokenizer, sampler=sampler,
                                 max_len=data.max_len, mixture=mixture, overlong=overlong)
    fresh, where = None, parallel.profile  # profile = "auto": a profile measured now (or shared), and whence
    if auto_profile:
        cost, fresh, where = auto_cost(job, spec=spec, configs=configs, world=world, sampler=sampler,
                                       env_world=env_world, log=log)
    _say_start(cost, where, resume_from, log)
    pool = propose_pool(cost, cluster, sampler, data, parallel) if setting.auto else parse_pool(setting.text, cluster)
    check_job_pool(pool, world, spec, cost, data.max_len)
    evaluation = _evaluation(job, corpus=corpus, open_corpus=named, cost=cost, world=world, pool=tuple(pool),
                             log=log)
    if fresh is not None:  # written only now: bad input leaves nothing behind
        _keep_profile(run_dir, fresh)
    if resume_from is not None:
        sweep_temporary(run_dir / "checkpoints", log)
    trainer = trainer_settings(spec, tuple(pool), cost, parallel=parallel, optim=job.optim, train=job.train)
    return RunSettings(trainer=trainer, data=data_settings, invocation=invocation, world=world, config_toml=job.toml,
                       eval=evaluation)


def trainer_settings(
    spec: ModelSpec, pool: tuple[Deployment, ...], cost: CostModel, *, parallel: ParallelChoice,
    optim: OptimSettings, train: TrainSettings,
) -> TrainerSettings:
    """What every rank's trainer runs: the model, the pool on the job's cost model (`overlap` in it), [optim] and
    [train] (the config's steps, resolved)."""
    return TrainerSettings(
        model=spec,
        parallel=ParallelSettings.of(pool, cost, parallel.overlap_exchange, memory_per_rank=parallel.memory_per_rank,
                                     zero_bubble=parallel.zero_bubble),
        optim=optim,
        train=train,
    )


def _evaluation(
    job: JobConfig, corpus: IndexedCorpus, open_corpus: Callable[[str, str], IndexedCorpus], cost: CostModel,
    world: int, pool: tuple[Deployment, ...], log: Log,
) -> EvalSet | None:
    """[eval]'s batches and plans: its own corpus, or the share of the training corpus the sampler left out."""
    ev = job.eval
    if not ev.enabled:
        return None
    held = ev.corpus is None
    source = corpus if held else open_corpus(ev.corpus, "eval.corpus")
    evaluation = eval_set(job.data, ev, corpus=source, held=held, cost=cost, world=world, pool=pool)
    log(f"evaluation: {evaluation.tokens:,} held-out tokens in {len(evaluation.batches)} batch(es), after "
        + (f"every {ev.every} steps and " if ev.every else "") + "the last step")
    return evaluation


def _keep_profile(run_dir: Path, fresh: dict) -> None:
    """A profile measured for this job, into the run directory; an interruption from now on says it is kept."""
    with interrupt.held():
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run_dir / AUTO_PROFILE, fresh)
        interrupt.keep(f"{run_dir / AUTO_PROFILE} (a run into the same --out uses it)")


def _check_run_dir(
    job: JobConfig, resume: bool, stop_at: int | None, log: Log, changes: tuple[bool, bool] = (False, False),
) -> str | None:
    """The run directory checked; on resume, the checkpoint to resume from. Damaged checkpoints are skipped
    (one line); none verifying is refused here, before any rank. `changes`: --change-schedule, --change-config."""
    run_dir, steps = job.run_dir, job.train.steps
    _check_out(run_dir, job.toml, resume)
    if not resume:
        return None
    check_config_change(run_dir, job.toml, changes[1], log, defaults=RunConfig().model_dump())
    point = resume_point(run_dir / "checkpoints", job.optim.lr_schedule_state(steps), changes[0], log)
    check_stop_at(stop_at, steps, point.step)
    return point.checkpoint


def _world(nproc: int | None, env_world: int | None, pool_gpus: int | None) -> int:
    """The job's rank count: torchrun's, else --nproc, else the pool's GPUs; it must be the pool's GPU count."""
    if env_world is not None:
        if nproc is not None and nproc != env_world:
            raise HydraulisError(f"--nproc {nproc} differs from torchrun's world size {env_world}; drop --nproc")
        world = env_world
    else:
        world = nproc if nproc is not None else (pool_gpus or 1)
    if world < 1:
        raise HydraulisError(f"--nproc must be positive, got {world}")
    if pool_gpus is not None and world > pool_gpus:
        raise HydraulisError(
            f"--nproc {world} is larger than the pool's {pool_gpus} GPUs; give a pool for {world} ranks or fewer ranks"
        )
    if pool_gpus is not None and world < pool_gpus:
        raise HydraulisError(
            f"the pool's deployments use {pool_gpus} GPUs but the job has {world} ranks; "
            f"run {pool_gpus} ranks (--nproc {pool_gpus}) or give a pool for {world}"
        )
    return world


def _corpus(tokenizer: str, token_ids: str, log: Log, workers: int | None, name: str, key: str) -> IndexedCorpus:
    """The corpus `name` of config key `key` (built when it is a builtin one or a source, on `workers`
    processes), tokenized with the model's tokenizer."""
    from hydraulis.data.builtin import resolve_corpus

    corpus = resolve_corpus(name, tokenizer, progress=True, log=log, workers=workers)
    if corpus.manifest.tokenizer != token_ids:
        made = corpus.manifest.tokenizer_source or corpus.manifest.tokenizer
        raise HydraulisError(
            f"{key} {name} is tokenized with {made} ({corpus.manifest.tokenizer}), "
            f"the model needs {tokenizer} ({token_ids}); rebuild it or set data.tokenizer"
        )
    return corpus


def data_sampler(
    corpus: IndexedCorpus, data: DataChoice, holdout: float, log: Log = say
) -> tuple[TokenBudgetSampler, Overlong | None]:
    """The run's sampler (the documents `[eval] holdout` leaves it) and what its max_len cuts (said in a line
    when anything); a run whose pieces hold no target token is refused: it would train on nothing."""
    sampler = run_sampler(data, holdout, corpus)
    cut = overlong(corpus, sampler)
    if cut is not None:
        check_targets_left(cut, f"[data] max_len = {data.max_len}, overlong = {data.overlong!r}")
        if cut.records:
            log(f"overlong: {cut.describe()}")
    return sampler, cut


def model_spec(model: ModelChoice, max_len: int) -> ModelSpec:
    """The model of the config; with init_from, the Hugging Face directory's own shape (at `[data] max_len`), its
    weights' files, tensor names and shapes checked against it (headers only) before any corpus, profile or
    rank."""
    if model.init_from is None:
        return model.shape
    from hydraulis.families import check_weights, read_hf_config

    path, _, spec = read_hf_config(model.init_from, max_len)
    if model.given:
        mine = model.shape
        differ = mine.shape_differences(spec)
        if differ:
            key = differ[0]
            raise HydraulisError(f"model.{key} is {getattr(mine, key)} but {path} says {getattr(spec, key)}; drop it")
    check_weights(model.init_from, spec)
    return spec


def _resumed_checkpoint(run_dir: Path, resume: bool, chosen: str | None) -> Path | None:
    """The checkpoint a resume starts from: the one verified above, or, on a torchrun rank other than 0
    (which did not choose), the same rule's choice made again."""
    if not resume or chosen is not None:
        return Path(chosen) if chosen is not None else None
    from hydraulis.checkpoints.manifest import latest_checkpoint

    return latest_checkpoint(run_dir / "checkpoints", sweep=False, log=lambda _: None)


def _say_start(cost: CostModel, where: str, checkpoint: str | None, log: Log) -> None:
    """The run's first word on what it starts from (auto_profile.start_lines); a resume's refit is the one its
    checkpoint planned with."""
    refit = None
    if checkpoint is not None:
        from hydraulis.checkpoints.manifest import read_manifest

        state = read_manifest(Path(checkpoint)).refit
        refit = f"refit: none (its checkpoint {checkpoint} planned without one)"
        if state is not None and state.coefficients:
            names = ", ".join(c.name for c in state.coefficients)
            refit = f"refit: its checkpoint's, after step {state.step} ({names})"
    for line in start_lines(cost.profile_data, where, refit):
        log(line)


def _padded(spec: ModelSpec, tp_degrees: set[int], resumed: Path | None) -> ModelSpec:
    """The model padded for these TP degrees; a resumed run keeps its checkpoint's padding if they all split it."""
    padded = spec.padded_for(tp_degrees)
    if resumed is None:
        return padded
    from hydraulis.checkpoints.manifest import read_manifest

    before = read_manifest(resumed).model
    if before.vocab == spec.vocab and all(before.vocab_rows % tp == 0 for tp in tp_degrees):
        return replace(spec, padded_vocab=before.padded_vocab)
    return padded


def _pool_configs(setting: PoolSetting, spec: ModelSpec, world: int) -> tuple[ParallelConfig, ...]:
    """The configs profile = "auto" measures: the pool's; with pool = "auto" every config the proposal may use.
    Each checked against the model (its heads and layers split as the config asks); an interleaved one is measured
    as its GPUs without interleaving (`base`), whose coefficients the cost model reads for every vp."""
    configs = setting.configs()
    if setting.auto:
        from hydraulis.cost.analytic import candidate_configs

        configs = [c for c in candidate_configs(spec, world) if world % c.num_gpus == 0 and c.cp == 1]
    for g in configs:
        g.validate(spec)
    return tuple(sorted({g.base for g in configs}, key=lambda c: (c.num_gpus, c.tp, c.pp, c.cp)))


def check_tokenizer(tokenizer: str, spec: ModelSpec, init_from: str | None) -> str:
    """The tokenizer's identity, once it is known to suit the model: its ids fit the vocabulary and,
    with init_from, it is the checkpoint's own tokenizer when the checkpoint ships one."""
    from hydraulis.data.tokenizer import get_tokenizer

    tok = get_tokenizer(tokenizer)
    if tok.vocab_size > spec.vocab:
        raise HydraulisError(
            f"model.vocab {spec.vocab} is smaller than the {tokenizer} tokenizer's {tok.vocab_size} token ids; "
            "choose the model's own tokenizer (data.tokenizer) or a larger vocabulary"
        )
    if init_from is not None and Path(tokenizer) != Path(init_from):
        from hydraulis.data.hf_tokenizer import TOKENIZER_FILE

        if (Path(init_from) / TOKENIZER_FILE).is_file():
            own = get_tokenizer(init_from)
            if own.name != tok.name:
                raise HydraulisError(
                    f"data.tokenizer {tokenizer} ({tok.name}) is not the tokenizer of model.init_from {init_from} "
                    f"({own.name}); drop data.tokenizer to use the checkpoint's own"
                )
    return tok.name


CONFIG_OVERLONG = "a lower [data] max_len ([data] overlong cuts longer documents)"


def crowded_ways(data: DataChoice, parallel: ParallelChoice) -> tuple[str, ...]:
    """The config's ways out of a CrowdedError, none of them what it already says."""
    ways = [f"a lower data.max_len (now {data.max_len})",
            f"a lower data.tokens_per_batch (now {data.tokens_per_batch}: fewer long sequences share a batch)",
            "more ranks (--nproc)"]
    if parallel.recompute is not True:
        ways.append("parallel.recompute = true")
    if parallel.memory_per_rank is not None:
        ways.append(f"a larger parallel.memory_per_rank (now {parallel.memory_per_rank})")
    return tuple(ways)


def propose_pool(
    cost: CostModel, cluster: ClusterSpec, sampler: TokenBudgetSampler, data: DataChoice, parallel: ParallelChoice
) -> tuple[Deployment, ...]:
    """Pool "auto": a pool proposed from sample batches of this data (another seed than training's). With
    `[parallel] interleave` the proposal weighs, as `hydraulis propose --interleave`, each config's interleaved
    forms beside it (`CostModel.with_interleaving`: above pp 2, where its layers split into chunks); the run
    trains them on `cost`, whose coefficients are the same stage's work."""
    from hydraulis.planner.proposal.propose import propose

    sample = TokenBudgetSampler(
        sampler.lengths, data.tokens_per_batch, data.max_len, data.seed + 1, data.overlong,
        documents=sampler.documents, mixture=sampler.mixture,  # the run's mixture of lengths
    ).batches(8)
    weighed = cost.with_interleaving() if parallel.interleave else cost
    weighed = cost if weighed.configs == cost.configs else weighed  # no config interleaves: the plain proposal
    try:
        proposal = propose(
            weighed, cluster, [b.lengths for b in sample], max_pool=parallel.max_pool, max_length=data.max_len
        )
    except OverlongError as exc:  # the planner's message names `plan`'s flags; the job words it in config keys
        raise HydraulisError(exc.worded(CONFIG_OVERLONG, "[parallel] profile = {}")) from None
    except CrowdedError as exc:
        raise HydraulisError(exc.worded(crowded_ways(data, parallel))) from None
    return tuple(proposal.pool.deployments)


def _check_out(run_dir: Path, toml: str, resume: bool) -> None:
    """The run directory may take this run (`toml`: its config.toml), or holds the run a resume continues."""
    if run_dir.exists() and not run_dir.is_dir():
        raise HydraulisError(f"{run_dir}: exists and is not a directory; choose another --out")
    if resume:
        if run_dir.is_dir() and (run_dir / "config.toml").is_file():
            return
        raise HydraulisError(f"{run_dir}: holds no run to resume (no config.toml); drop --resume or fix --out")
    # A directory holding only an auto profile and the log (a run that failed to start) is run into again.
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} - {AUTO_PROFILE, TRANSCRIPT}:
        previous = run_dir / "config.toml"
        if previous.is_file() and previous.read_text(encoding="utf-8") == toml:
            raise HydraulisError(f"{run_dir}: already holds this run; add --resume to continue it or choose --out")
        raise HydraulisError(f"{run_dir}: already holds a different run (or other files); choose another --out")
