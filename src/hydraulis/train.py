"""A training job: from a run config to ranks that train and a run directory that shows it.

`prepare` does everything that can fail on bad input BEFORE any rank starts
or any file is written: it validates the config, opens (or builds) the
corpus, loads the cost model, places or proposes the pool for the world
size, and checks that the model fits some config of the pool at max_len.
`run_rank` is what every rank executes (under torchrun, or spawned by
`hydraulis train --nproc N`); rank 0 writes the run directory:

- `metrics.jsonl`: one object per step (flushed as it goes, so a failed run
  keeps what it measured), and a last `{"summary": ...}` line;
- TensorBoard event files (`tb/`), `config.toml` (the resolved config),
  `pool.json`, `summary.json` and, at the end, `report.png`;
- with `[parallel] profile = "auto"`, `profile.json`: the pool's configs
  measured by `hydraulis profile`'s machinery on this job's device and world
  size before training, the cost model of the run. A later run in the same
  directory (--resume, or a rerun after a failed start) reuses it when it
  describes the same model, configs, device, dtype, world size and sweep.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hydraulis.config import RunConfig, pool_world
from hydraulis.cost import CostModel, load_cost_model
from hydraulis.cost.sweep import ProfileSettings
from hydraulis.errors import HydraulisError
from hydraulis.files import write_text_atomic
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.pool import Pool, check_job_pool, load_pool, parse_pool, save_pool
from hydraulis.specs import ClusterSpec, ModelSpec

RUN_FILES = ("metrics.jsonl", "config.toml", "pool.json", "summary.json", "report.png", "tb", "profile.json")
AUTO_PROFILE = "profile.json"  # profile = "auto": the measured profile, cached in the run directory


@dataclass(frozen=True)
class Job:
    """Everything a rank needs, resolved and checked in the parent (picklable for spawn)."""

    config: RunConfig
    spec: ModelSpec
    cost: CostModel
    pool: tuple[Deployment, ...]
    world: int
    corpus_path: str
    tokenizer: str
    out: str
    steps: int
    resume: bool = False
    max_restarts: int = 0

    @property
    def checkpoints(self) -> Path:
        return Path(self.out) / "checkpoints"


def _world_from_env() -> int | None:
    """The world size torchrun gives this process, or None when it runs alone."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def prepare(
    config: RunConfig,
    nproc: int | None,
    out: str | None,
    steps: int | None,
    resume: bool,
    max_restarts: int = 0,
) -> Job:
    """A checked job; raises HydraulisError (one line) on any bad input, having written nothing."""
    from hydraulis.data.builtin import resolve_corpus
    from hydraulis.data.sampler import TokenBudgetSampler

    run_dir = Path(out or config.train.out)
    steps = steps if steps is not None else config.train.steps
    # The resolved config: what config.toml records, so a run directory says what it ran.
    config = config.model_copy(update={"train": config.train.model_copy(update={"out": str(run_dir), "steps": steps})})
    # torchrun restarts every worker with the same arguments after a failure: continue, don't start over.
    resume = resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    if max_restarts < 0:
        raise HydraulisError(f"--max-restarts must be non-negative, got {max_restarts}")
    spec = model_spec(config)
    auto = config.parallel.profile == "auto"  # measured below, once the world size and the pool are known
    cost = None if auto else job_cost_model(config.parallel.profile, spec)
    if cost is not None:
        cost = cost.with_recompute(config.parallel.recompute_configs(cost.configs))
    tokenizer = config.data.tokenizer_for(spec)
    env_world = _world_from_env()
    if env_world is None or int(os.environ["RANK"]) == 0:
        _check_out(run_dir, config, resume)  # under torchrun rank 0 writes the run directory, and checks it
    pool_spec = config.parallel.pool
    inline = pool_spec != "auto" and not Path(pool_spec).is_file() and not pool_spec.endswith(".json")
    pool_gpus = pool_world(pool_spec).world if inline else None
    if pool_spec != "auto" and not inline:
        pool_gpus = load_pool(pool_spec).cluster.num_gpus
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
    gpn = config.parallel.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cluster = ClusterSpec(world, min(gpn, world))
    corpus = resolve_corpus(config.data.corpus, tokenizer, progress=True)
    if corpus.manifest.tokenizer != tokenizer:
        raise HydraulisError(
            f"corpus {config.data.corpus} is tokenized with {corpus.manifest.tokenizer}, "
            f"the model needs {tokenizer}; rebuild it or set data.tokenizer"
        )
    vocab_needed = get_vocab(tokenizer)
    if vocab_needed > spec.vocab:
        raise HydraulisError(f"model.vocab {spec.vocab} is smaller than the {tokenizer} tokenizer's {vocab_needed}")
    d = config.data
    sampler = TokenBudgetSampler(corpus.lengths, d.tokens_per_batch, d.max_len, d.seed, d.overlong)
    fresh = None  # profile = "auto": a profile measured now, written once every check has passed
    if auto:
        from hydraulis.cost import ProfiledCostModel

        configs = _pool_configs(pool_spec, inline, spec, world)
        config.parallel.recompute_configs(configs)  # a bad recompute list fails before minutes of profiling
        request = AutoProfile.of(config, spec, configs, world, sampler.piece_lengths())
        cached = request.cached(run_dir / AUTO_PROFILE)
        fresh = None if cached is not None else request.measure(torchrun=env_world is not None)
        cost = ProfiledCostModel.from_dict(cached or fresh, str(run_dir / AUTO_PROFILE))
        cost = cost.with_recompute(config.parallel.recompute_configs(cost.configs))
    if pool_spec == "auto":
        pool = _propose(cost, cluster, sampler, config, d.max_len)
    elif inline:
        pool = parse_pool(pool_spec, cluster)
    else:
        pool = load_pool(pool_spec, cluster).deployments
    check_job_pool(pool, world, spec, cost, d.max_len)
    if fresh is not None:  # written only now: bad input leaves nothing behind
        from hydraulis.jsonio import write_json_atomic

        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run_dir / AUTO_PROFILE, fresh)
    return Job(
        config=config,
        spec=spec,
        cost=cost,
        pool=tuple(pool),
        world=world,
        corpus_path=str(corpus.path),
        tokenizer=tokenizer,
        out=str(run_dir),
        steps=steps,
        resume=resume,
        max_restarts=max_restarts,
    )


def model_spec(config: RunConfig) -> ModelSpec:
    """The model of the config; with init_from, the Hugging Face directory's own shape."""
    m = config.model
    if m.init_from is None:
        return m.spec()
    from hydraulis.runtime.hf_io import read_hf_config

    path, _, spec = read_hf_config(m.init_from)
    given = m.model_fields_set - {"init_from"}
    if given:
        mine = m.spec()
        differ = mine.shape_differences(spec)
        if differ:
            k = differ[0]
            raise HydraulisError(f"model.{k} is {getattr(mine, k)} but {path} says {getattr(spec, k)}; drop it")
    return spec


def job_cost_model(profile: str, spec: ModelSpec) -> CostModel:
    """load_cost_model, plus `@DEVICE`: the analytic model of the trained model's own shape on DEVICE."""
    if profile.startswith("@"):
        from hydraulis.cost import AnalyticCostModel
        from hydraulis.specs import get_device

        return AnalyticCostModel(spec, get_device(profile[1:]))
    return load_cost_model(profile)


def _pool_configs(pool_spec: str, inline: bool, spec: ModelSpec, world: int) -> tuple[ParallelConfig, ...]:
    """The configs profile = "auto" measures: the pool's; with pool = "auto" every config the proposal may use."""
    if inline:
        from hydraulis.parallel import parse_configs

        configs = [c for text in pool_world(pool_spec).deployments for c in parse_configs(text)]
    elif pool_spec != "auto":
        configs = [r.config for d in load_pool(pool_spec).deployments for r in d.replicas]
    else:
        from hydraulis.cost.analytic import candidate_configs

        configs = [c for c in candidate_configs(spec, world) if world % c.num_gpus == 0 and c.cp == 1]
    return tuple(sorted(set(configs), key=lambda c: (c.num_gpus, c.tp, c.pp, c.cp)))


def _sweep_for(max_len: int, lengths: np.ndarray) -> dict[str, Any]:
    """The sweep of profile = "auto": the documents this job trains, from its 10th percentile up to max_len.

    Why: a, b, c are fitted where the planner will use them. Below the data's
    short tail, per-document overheads the model has no term for would pull
    the fit (and under-predict the long documents that set iteration times).
    Powers of two: the longest is max_len rounded up (at least 256), the shortest
    at least 128 and at most a quarter of it (three sizes to separate a from b);
    totals up to two of the longest.
    """
    top = 1 << max(8, (max_len - 1).bit_length())
    tenth = int(np.percentile(lengths, 10)) if len(lengths) else 128
    low = min(max(128, 1 << max(0, tenth.bit_length() - 1)), max(128, top // 4))
    totals = tuple(1 << k for k in range(low.bit_length() - 1, top.bit_length() + 1))
    return {"totals": totals, "min_doc": low, "max_doc": top}


@dataclass(frozen=True)
class AutoProfile:
    """`profile = "auto"`: these configs of this model, measured on this job's device, dtype and world size."""

    spec: ModelSpec
    configs: tuple[ParallelConfig, ...]
    world: int
    device: str  # cpu or cuda, as the ranks will train
    settings: ProfileSettings

    @classmethod
    def of(
        cls, config: RunConfig, spec: ModelSpec, configs: tuple[ParallelConfig, ...], world: int, lengths: np.ndarray
    ) -> AutoProfile:
        from hydraulis.cost.sweep import check_configs

        device = config.train.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        settings = ProfileSettings(**_sweep_for(config.data.max_len, lengths), dtype=config.train.dtype)
        try:
            check_configs(spec, configs, world, device)
        except HydraulisError as exc:
            raise HydraulisError(f'parallel.profile = "auto": {exc}') from None
        return cls(spec, configs, world, device, settings)

    def mismatch(self, data: dict[str, Any]) -> str | None:
        """Why a cached profile does not describe this job (None: it does)."""
        device = data.get("device") or {}
        measurements = data.get("measurements") or {}
        have = {(r.get("tp"), r.get("pp"), r.get("cp", 1)) for r in data.get("time_ms") or [] if isinstance(r, dict)}
        missing = [c.name for c in self.configs if (c.tp, c.pp, c.cp) not in have]
        if data.get("model") != asdict(self.spec):
            return "another model"
        if device.get("kind") != self.device or device.get("dtype") != self.settings.dtype_for(self.device):
            return "another device or dtype"
        if measurements.get("world_size") != self.world:
            return "another world size"
        if measurements.get("settings") != self.settings.to_json():
            return "another sweep"
        if missing:
            return f"it lacks {', '.join(missing)}"
        return None

    def cached(self, path: Path) -> dict[str, Any] | None:
        """The profile at `path` if it describes this job; None (and why, on the terminal) otherwise."""
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            data = None
        reason = "unreadable" if not isinstance(data, dict) else self.mismatch(data)
        if reason is None:
            print(f"cost model: {path} (profiled before for this model, pool, device and world size)", flush=True)
            return data
        print(f"profiling again: {path} does not describe this job ({reason})", flush=True)
        return None

    def measure(self, torchrun: bool) -> dict[str, Any]:
        """Profile the configs now on `world` local processes, with a progress bar; returns the profile data."""
        if torchrun:
            raise HydraulisError(
                'parallel.profile = "auto" cannot profile under torchrun: run `hydraulis train --nproc` once, '
                "or `hydraulis profile` and set parallel.profile to its file"
            )
        from hydraulis.profile import check_job, profile_model, progress_steps
        from hydraulis.progress import steps_progress

        check_job(self.spec, self.configs, self.world, self.device)
        names = ", ".join(c.name for c in self.configs)
        print(f"profiling {self.spec.name} ({names}) on {self.world} {self.device} rank(s) for the cost model",
              flush=True)
        with steps_progress("profiling", progress_steps(self.configs, self.settings, self.world)) as step:
            data = profile_model(self.spec, self.configs, self.world, self.device, self.settings, progress=step)
        held = ", ".join(
            f"{name} {fid['holdout']['median_abs_rel_error']:.0%}" for name, fid in data["fidelity"].items()
        )
        print(f"profiled in {data['measurements']['wall_s']:.0f} s; held-out median error per config: {held}",
              flush=True)
        return data


def get_vocab(tokenizer: str) -> int:
    from hydraulis.data.tokenizer import get_tokenizer

    return get_tokenizer(tokenizer).vocab_size


def _propose(cost: CostModel, cluster: ClusterSpec, sampler, config: RunConfig, max_len: int):
    """Pool "auto": a pool proposed from sample batches of this data (another seed than training's)."""
    from hydraulis.data.sampler import TokenBudgetSampler
    from hydraulis.planner.proposal import propose

    d = config.data
    sample = TokenBudgetSampler(sampler.lengths, d.tokens_per_batch, d.max_len, d.seed + 1, d.overlong).batches(8)
    proposal = propose(cost, cluster, [b.lengths for b in sample], max_pool=config.parallel.max_pool,
                       max_length=max_len)
    return proposal.pool.deployments


def _check_out(run_dir: Path, config: RunConfig, resume: bool) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise HydraulisError(f"{run_dir}: exists and is not a directory; choose another --out")
    if resume:
        if run_dir.is_dir() and (run_dir / "config.toml").is_file():
            return
        raise HydraulisError(f"{run_dir}: holds no run to resume (no config.toml); drop --resume or fix --out")
    # A directory holding only an auto profile (a run that failed to start) is run into again.
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} - {AUTO_PROFILE}:
        previous = run_dir / "config.toml"
        if previous.is_file() and previous.read_text(encoding="utf-8") == config.to_toml():
            raise HydraulisError(f"{run_dir}: already holds this run; add --resume to continue it or choose --out")
        raise HydraulisError(f"{run_dir}: already holds a different run (or other files); choose another --out")


# ---------------------------------------------------------------------------------------------- ranks


def run_rank(job: Job) -> dict[str, Any] | None:
    """One rank's training; rank 0 returns the run summary."""
    from hydraulis.data.indexed import open_corpus
    from hydraulis.data.sampler import TokenBudgetSampler
    from hydraulis.runtime.launch import init_distributed
    from hydraulis.runtime.optimizer import AdamW
    from hydraulis.runtime.trainer import OptimSettings, Trainer, TrainSettings

    c = job.config
    env = init_distributed(c.train.device)
    corpus = open_corpus(job.corpus_path)
    d = c.data
    sampler = TokenBudgetSampler(corpus.lengths, d.tokens_per_batch, d.max_len, d.seed, d.overlong)
    o = c.optim
    settings = TrainSettings(
        model=job.spec,
        pool=job.pool,
        cost=job.cost,
        optim=OptimSettings(
            lr=o.lr,
            warmup=o.warmup,
            schedule=o.schedule,
            min_lr_ratio=o.min_lr_ratio,
            adamw=AdamW(betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, grad_clip=o.grad_clip),
        ),
        steps=job.steps,
        seed=d.seed,
        dtype=c.train.dtype,
        sequence_parallel=c.parallel.sequence_parallel,
    )
    trainer = Trainer(settings, corpus, sampler, env)
    say = _say(env.rank)
    if job.resume:
        from hydraulis.runtime.checkpoint import resume

        info = resume(trainer, job.checkpoints, log=say)
        say(f"resuming at step {trainer.step_index}" if info else "no checkpoint yet: starting from step 0")
    elif c.model.init_from:
        from hydraulis.runtime.hf_io import init_from

        init_from(trainer, c.model.init_from)
        say(f"initialised from {c.model.init_from}")
    log = RunLog(job, trainer.step_index) if env.rank == 0 else None
    stop = StopRequest()
    try:
        while trainer.step_index < job.steps:
            metrics = trainer.step()
            if log is not None:
                log.step(metrics)
            stopping = stop.agreed(trainer)
            every = c.train.checkpoint_every
            if stopping or trainer.step_index == job.steps or (every and trainer.step_index % every == 0):
                from hydraulis.runtime.checkpoint import save_checkpoint

                path = save_checkpoint(trainer, job.checkpoints, keep=c.train.keep_checkpoints, log=say)
                say(f"saved {path}")
            if stopping:
                say(f"stopped by {stop.name} at step {trainer.step_index}; continue with --resume")
                break
    finally:
        stop.restore()
        trainer.close()
        if log is not None:
            log.close()
    return log.finish() if log is not None else None


def _say(rank: int):
    def say(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    return say


class StopRequest:
    """SIGTERM or SIGINT (preemption, Ctrl-C): finish the step, save, and leave with exit code 0.

    Ranks may see the signal at different times, so at every step boundary
    they agree (one tiny all-reduce) and stop together.
    """

    def __init__(self) -> None:
        import signal

        self.name: str | None = None
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        import signal

        self.name = signal.Signals(signum).name

    def agreed(self, trainer) -> bool:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self.name else 0], dtype=torch.int64)
        if trainer.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=trainer.control)
        if int(flag) and self.name is None:
            self.name = "a signal to another rank"
        return bool(int(flag))

    def restore(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class RunLog:
    """Rank 0's view of the run: metrics file, TensorBoard, terminal progress, summary and report."""

    def __init__(self, job: Job, start_step: int = 0) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.job = job
        self.out = Path(job.out)
        self.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.out / "config.toml", job.config.to_toml())
        save_pool(self.out / "pool.json", Pool(job.cost.name, ClusterSpec(job.world, job.world), job.pool))
        # On resume, keep the steps before the checkpoint; later ones (and old summaries) are redone.
        self.rows = _metrics_before(self.out / "metrics.jsonl", start_step)
        write_text_atomic(self.out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in self.rows))
        self.metrics_file = open(self.out / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.tb = _tensorboard(self.out / "tb")
        self.console = Console()
        self.progress = Progress(
            TextColumn("training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        self.task = self.progress.add_task("train", total=job.steps, completed=start_step, info="")
        self.progress.start()
        self.console.print(
            f"training {job.spec.name} ({job.spec.num_params / 1e6:.2f}M parameters) on {job.world} rank(s); pool: "
            + "; ".join(str(d) for d in job.pool)
        )

    def step(self, m) -> None:
        row = m.to_dict()
        self.rows.append(row)
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        if self.tb is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "iteration_s", "predicted_s", "planning_s"):
                self.tb.add_scalar(f"train/{key}", row[key], m.step)
            self.tb.add_scalar("train/deployment", m.deployment_index, m.step)
        info = f"loss {m.loss:.3f}"
        self.progress.update(self.task, advance=1, info=info)
        if m.step % self.job.config.train.log_every == 0 or m.step == self.job.steps - 1:
            measured = ", ".join(f"{t:.3f}" for t in m.replica_s)
            predicted = ", ".join(f"{t:.3f}" for t in m.replica_predicted_s)
            self.console.print(
                f"step {m.step:>4}  loss {m.loss:6.3f}  {m.tokens_per_s:>7,.0f} tok/s  {m.deployment}"
                f"  {m.iteration_s:.2f} s (predicted {m.predicted_s:.2f})" + ("  switched" if m.switched else ""),
                highlight=False,
            )
            self.console.print(f"      replicas measured [{measured}] s, predicted [{predicted}] s", highlight=False)

    def close(self) -> None:
        self.progress.stop()
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if not self.metrics_file.closed:
            self.metrics_file.close()

    def finish(self) -> dict[str, Any]:
        summary = summarize(self.rows)
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"summary": summary}) + "\n")
        from hydraulis.jsonio import write_json_atomic

        write_json_atomic(self.out / "summary.json", summary)
        if self.rows:
            report_plot(self.rows, self.out / "report.png", f"{self.job.spec.name} on {self.job.world} rank(s)")
        shares = ", ".join(f"{k}: {v:.0%}" for k, v in summary["deployment_share"].items())
        self.console.print(
            f"done: {summary['steps']} steps, loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}, "
            f"mean {summary['tokens_per_s']:,.0f} tokens/s; steps per deployment: {shares}; "
            f"{summary['switches']} switch(es) costing {summary['switch_s']:.3f} s; "
            f"planning not hidden {summary['planning_unhidden_s']:.3f} s of {summary['planning_s']:.3f} s; "
            f"iteration time predicted/measured median error {summary['iteration_error_median']:.0%}"
        )
        self.console.print(f"run directory: {self.out} (metrics.jsonl, report.png, tb/, config.toml, pool.json)")
        return summary


def _metrics_before(path: Path, step: int) -> list[dict[str, Any]]:
    if step == 0 or not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(row, dict) and "step" in row and row["step"] < step:
            rows.append(row)
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {"steps": 0}
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["iteration_s"] for r in rows)
    counts = Counter(r["deployment"] for r in rows)
    errors = iteration_errors(rows)
    return {
        "steps": len(rows),
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "deployment_share": {k: v / len(rows) for k, v in counts.most_common()},
        "switches": sum(1 for r in rows if r["switched"]),
        "switch_s": sum(r["switch_s"] for r in rows if r["switched"]),
        "planning_s": sum(r["planning_s"] for r in rows),
        "planning_unhidden_s": sum(r["planning_unhidden_s"] for r in rows),
        "iteration_error_median": statistics.median(errors) if errors else 0.0,
        "iteration_error_max": max(errors) if errors else 0.0,
    }


def iteration_errors(rows: list[dict[str, Any]]) -> list[float]:
    """|predicted - measured| / measured iteration time of each step: the cost model's fidelity in training."""
    return [abs(r["predicted_s"] - r["iteration_s"]) / r["iteration_s"] for r in rows if r["iteration_s"] > 0]


def _tensorboard(path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None  # tensorboard is optional for training; metrics.jsonl has everything
    return SummaryWriter(str(path))


def report_plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Loss, tokens/s, deployment per step, and predicted against measured replica times."""
    from hydraulis.plots import pyplot, save_figure

    plt = pyplot()
    steps = np.array([r["step"] for r in rows])
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    ax = axes[0, 0]
    ax.plot(steps, [r["loss"] for r in rows], color="tab:blue")
    ax.set(title="loss (mean over the global batch's target tokens)", xlabel="step", ylabel="loss")
    ax = axes[0, 1]
    ax.plot(steps, [r["tokens_per_s"] for r in rows], color="tab:green")
    ax.set(title="throughput", xlabel="step", ylabel="tokens/s")
    ax = axes[1, 0]
    names = list(dict.fromkeys(r["deployment"] for r in rows))
    ax.scatter(steps, [names.index(r["deployment"]) for r in rows], s=12, c="tab:purple")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set(title="deployment of each step", xlabel="step")
    ax = axes[1, 1]
    predicted = np.array([t for r in rows for t in r["replica_predicted_s"]])
    measured = np.array([t for r in rows for t in r["replica_s"]])
    busy = measured > 0
    ax.scatter(predicted[busy], measured[busy], s=10, alpha=0.6, label="replica (busy)")
    ax.scatter([r["predicted_s"] for r in rows], [r["iteration_s"] for r in rows], s=10, alpha=0.6,
               label="iteration", color="tab:red")
    top = float(max(predicted.max(initial=0), measured.max(initial=0), max(r["iteration_s"] for r in rows))) * 1.05
    ax.plot([0, top], [0, top], color="gray", lw=1, ls="--", label="measured = predicted")
    ax.fill_between([0, top], [0, top / 1.15], [0, top / 0.85], color="gray", alpha=0.12, lw=0, label="within 15%")
    errors = iteration_errors(rows)
    median = f"{statistics.median(errors):.0%}" if errors else "n/a"
    worst = f"{max(errors):.0%}" if errors else "n/a"
    ax.set(title=f"cost model: predicted vs measured\niteration time error: median {median}, worst {worst}",
           xlabel="predicted s", ylabel="measured s", xlim=(0, top), ylim=(0, top))
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)


def run(job: Job) -> dict[str, Any] | None:
    """Run the job here (under torchrun) or on `job.world` local processes; returns rank 0's summary."""
    from hydraulis.runtime.launch import spawn

    if _world_from_env() is not None or job.world == 1:
        return run_rank(job)
    from dataclasses import replace

    from hydraulis.runtime.launch import RankFailed

    start = time.perf_counter()
    for attempt in range(job.max_restarts + 1):
        try:
            results = spawn(run_rank, job.world, job)
            break
        except RankFailed as exc:
            if attempt == job.max_restarts:
                raise
            print(f"{exc}; restarting from the last checkpoint ({attempt + 1} of {job.max_restarts})", flush=True)
            job = replace(job, resume=True)
    summary = results[0]
    if summary is not None:
        summary["wall_s"] = time.perf_counter() - start
    return summary
