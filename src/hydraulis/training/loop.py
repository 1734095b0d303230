"""The training loop: every rank runs `run_rank`; `run` starts the ranks here or joins torchrun's.

One loop that reads top to bottom: plan and step (the trainer plans the next
batch in the background while this one computes), log, maybe checkpoint,
maybe stop. What it drives sits beside it: the `Trainer` (runtime/trainer.py),
assembled from the job's settings, corpus and sampler; the `CheckpointManager`
(checkpoints/saver.py), handed the trainer's stateful parts; the `RunLog`
(run_log.py) and a `StopRequest` for SIGTERM and SIGINT. Everything that can fail
on bad input was checked before, in job.py.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from hydraulis.checkpoints.rundir import check_shared_run_dir
from hydraulis.checkpoints.saver import CheckpointManager, Saved
from hydraulis.data.indexed import IndexedCorpus, open_corpus
from hydraulis.progress import keep_going, say, transcribe
from hydraulis.runtime.divergence import DivergenceGuard
from hydraulis.runtime.evaluate import evaluate
from hydraulis.runtime.parallelism.launch import RankFailed, init_distributed, leave_distributed, spawn
from hydraulis.runtime.parallelism.timeouts import first_step_timeout
from hydraulis.runtime.trainer import Trainer, TrainSettings
from hydraulis.training.job import Job, torchrun_world
from hydraulis.training.run_fidelity import RunFidelity
from hydraulis.training.run_log import RunLog


def run(job: Job) -> dict[str, Any] | None:
    """Run the job here (under torchrun) or on `job.world` local processes; returns rank 0's summary.

    A failed local rank restarts the job from the last checkpoint, at most `job.max_restarts` times.
    """
    if torchrun_world() is not None or job.world == 1:
        summary = run_rank(job)
        leave_distributed()  # as a spawned rank does (launch._child)
        return summary
    start = time.perf_counter()
    for attempt in range(job.max_restarts + 1):
        try:
            results = spawn(run_rank, job.world, job)
            break
        except RankFailed as exc:
            if attempt == job.max_restarts:
                raise
            say(f"{exc}; restarting from the last checkpoint ({attempt + 1} of {job.max_restarts})")
            job = replace(job, resume=True, resume_from=None)  # rank 0 picks again
    summary = results[0]
    if summary is not None:
        summary["wall_s"] = time.perf_counter() - start
    return summary


def run_rank(job: Job) -> dict[str, Any] | None:
    """One rank's training; rank 0 returns the run summary.

    The stop request comes first: a SIGTERM or SIGINT while the rank starts (joining, building, resuming)
    stops the run cleanly at its first step boundary, as one during training does, instead of killing the
    rank half-way through writing its run directory.
    """
    stop = StopRequest()
    keep_going()  # the ranks share the launcher's terminal: one that goes away must not stop them
    try:
        return _train(job, stop)
    finally:
        stop.restore()


def _train(job: Job, stop: StopRequest) -> dict[str, Any] | None:
    config, settings = job.config, train_settings(job)
    env = init_distributed(config.train.device, first_step_timeout(settings.timeout_s))
    corpus = job.mixture.open() if job.mixture is not None else open_corpus(job.corpus_path)
    trainer = Trainer(settings, corpus, job.sampler, env)
    check_shared_run_dir(Path(job.out), env.rank, env.world_size, trainer.control)  # before any file is written
    log = say if env.rank == 0 else _silent
    if env.rank == 0:
        transcribe(job.transcript)
    checkpoints = CheckpointManager(
        Saved.of(trainer), job.checkpoints, config.train.checkpoint_every, config.train.keep_checkpoints,
        job.end_step, log,
    )
    resumed = checkpoints.resume(chosen=job.resume_from, new_corpus=job.change_config) if job.resume else None
    if resumed is not None:
        log(f"resuming at step {trainer.step_index}")
    else:  # a fresh start, also a resume (or a restart) before the first checkpoint: init_from included
        if job.resume:
            log("no checkpoint yet: starting from step 0")
        if config.model.init_from:
            from hydraulis.runtime.storage.hf_io import init_from

            init_from(trainer.optimizer, config.model.init_from)
            log(f"initialised from {config.model.init_from}")
    start = trainer.step_index
    run_log = RunLog(job, start, tensorboard(Path(job.out) / "tb", start)) if env.rank == 0 else None
    pids: list[Any] = [os.getpid()] * env.world_size  # the job's own processes, for rank 0's load meter
    if env.world_size > 1:
        dist.all_gather_object(pids, os.getpid(), group=trainer.control)
    watch = RunFidelity(job, trainer, pids, torch.get_num_threads(), log, resumed) if env.rank == 0 else None
    guard = DivergenceGuard(config.train.max_bad_steps)
    evaluation = Evaluation(job, corpus)
    try:
        while trainer.step_index < job.end_step:
            metrics = trainer.step()
            measured = watch.after(metrics) if watch is not None else None  # the load; maybe a refit
            evaluated = evaluation.after(trainer)  # every rank, when [eval] is due
            if run_log is not None:
                sources = corpus.source_counts(trainer.feed.last) if job.mixture is not None else {}
                run_log.step(metrics, {**(measured or {}), **evaluated, **sources})
            skipped = guard.check(metrics.step, metrics.loss, metrics.grad_norm, metrics.skipped)  # raises at the limit
            if skipped:
                log(skipped)
            stopping = stop.agreed(trainer)
            checkpoints.maybe_save(stopping, watch.refit.state() if watch is not None else None)
            if stopping:
                log(f"stopped by {stop.name} at step {trainer.step_index}; continue with --resume")
                break
        else:
            if trainer.step_index < job.steps:
                log(f"stopped at step {trainer.step_index} (--stop-at) of {job.steps}; continue with --resume")
            elif config.train.compare_steps:
                log(f"measuring the last {len(trainer.recent)} batches again on each homogeneous deployment")
                comparison = trainer.compare(config.train.compare_repeats)
                if run_log is not None and comparison is not None:
                    run_log.compared(comparison.to_dict())
    finally:
        trainer.close()
        if run_log is not None:
            run_log.close()
    return run_log.finish(trainer.feed.planner) if run_log is not None else None


class Evaluation:
    """[eval] during a run: the held-out loss after the steps it is due (training/evaluation.py), as metrics."""

    def __init__(self, job: Job, corpus: IndexedCorpus) -> None:
        self.set, self.last = job.evaluation, job.steps
        self.corpus = corpus
        if self.set is not None and self.set.corpus_path != job.corpus_path:
            self.corpus = open_corpus(self.set.corpus_path)

    def after(self, trainer: Trainer) -> dict[str, Any]:
        """The metrics of an evaluation now if one is due (every rank runs it), else nothing."""
        if self.set is None or not self.set.due(trainer.step_index, self.last):
            return {}
        result = evaluate(trainer, self.set.batches, self.set.plans, self.corpus).to_dict()
        return {f"eval_{key}": value for key, value in result.items() if key != "step"}  # the row has the step


def train_settings(job: Job) -> TrainSettings:
    """The trainer's settings from the job's config; what the job's cost model holds comes with it."""
    config = job.config
    return TrainSettings(
        model=job.spec,
        pool=job.pool,
        cost=job.cost,
        optim=config.optim.settings(),
        steps=job.steps,
        seed=config.data.seed,
        dtype=config.train.dtype,
        compare_steps=config.train.compare_steps,
        reduce_dtype=config.train.reduce_dtype,
        timeout_s=config.train.timeout_s,
        overlap=config.parallel.overlap_exchange,
    )


def _silent(message: str) -> None:
    """The log of ranks other than 0: rank 0 speaks for the job."""


def tensorboard(path: Path, start_step: int = 0) -> Any:
    """A TensorBoard writer for the run log, or None without tensorboard (metrics.jsonl has everything).

    Resuming at step k purges the events of steps >= k, so no step appears twice.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(path), purge_step=start_step or None)


class StopRequest:
    """SIGTERM or SIGINT (preemption, Ctrl-C): finish the step, save, and leave with exit code 0.

    Ranks may see the signal at different times, so at every step boundary
    they agree (one tiny all-reduce) and stop together.
    """

    def __init__(self) -> None:
        self.name: str | None = None
        self._previous: dict[signal.Signals, Any] = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.name = signal.Signals(signum).name

    def agreed(self, trainer: Trainer) -> bool:
        flag = torch.tensor([1 if self.name else 0], dtype=torch.int64)
        if trainer.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=trainer.control)
        if int(flag) and self.name is None:
            self.name = "a signal to another rank"
        return bool(int(flag))

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
