"""One rank's run: `Run` builds every part from the run's settings and owns the loop, evaluation and checkpoints.

training/loop.py starts a `Run` on every rank. It reads top to bottom: plan
and step (the trainer plans the next batch in the background while this one
computes, or when its step begins where CPU ranks fill the cores; the first
step settles the timeouts), watch the predictions
(rank 0), evaluate when `[eval]` is due, log, guard against divergence, maybe
checkpoint, maybe stop. Its parts, each built by keyword from `RunSettings`
(training/settings.py) and nothing else: the `Trainer` (runtime/trainer.py),
the `CheckpointManager` (checkpoints/saver.py), handed the states it
saves, the `RunLog` (run_log.py), the `RunFidelity` watch (run_fidelity.py),
the `DivergenceGuard` (runtime/divergence.py) and a `StopRequest` for SIGTERM
and SIGINT. `Run(...)` builds the parts; `train` resumes (or starts fresh), then
runs the loop. Everything that can fail on bad input was checked before, in job.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from hydraulis.checkpoints.manifest import CheckpointInfo
from hydraulis.checkpoints.rundir import check_shared_run_dir
from hydraulis.checkpoints.saver import CheckpointManager, Saved
from hydraulis.data.indexed import IndexedCorpus, open_corpus
from hydraulis.progress import say, transcribe
from hydraulis.runtime.divergence import DivergenceGuard
from hydraulis.runtime.evaluation import evaluate
from hydraulis.runtime.metering.step_meter import StepMetrics
from hydraulis.runtime.parallelism.launch import init_distributed
from hydraulis.runtime.parallelism.timeouts import first_step_timeout
from hydraulis.runtime.trainer import Trainer
from hydraulis.training.mixture import MixedCorpus
from hydraulis.training.run_fidelity import RunFidelity
from hydraulis.training.run_log import RunLog
from hydraulis.training.settings import RunSettings


class Run:
    """One rank's training (module docstring); rank 0 also keeps the run's record and watches its predictions."""

    def __init__(self, settings: RunSettings, stop: StopRequest) -> None:
        train = settings.trainer.train
        self.settings = settings
        self.stop = stop
        self.env = init_distributed(train.device, first_step_timeout(train.timeout_s))
        self.corpus = training_corpus(settings)
        self.trainer = Trainer(settings=settings.trainer, corpus=self.corpus, sampler=settings.data.sampler,
                               env=self.env)
        check_shared_run_dir(settings.out, self.env.rank, self.env.world_size, self.trainer.control)  # before writing
        self.log = say if self.env.rank == 0 else _silent
        if self.env.rank == 0:
            transcribe(settings.transcript)
        self.checkpoints = CheckpointManager(
            states=Saved.of(self.trainer), directory=settings.checkpoints, every=train.checkpoint_every,
            keep=train.keep_checkpoints,
            last_step=settings.end_step, log=self.log,
        )
        self.guard = DivergenceGuard(train.max_bad_steps)
        held = settings.eval
        self.eval_corpus = self.corpus
        if held is not None and held.corpus_path != settings.data.corpus_path:
            self.eval_corpus = open_corpus(held.corpus_path)
        self.run_log: RunLog | None = None  # rank 0's record and watch start where the run starts (`train`)
        self.watch: RunFidelity | None = None

    def _start(self) -> CheckpointInfo | None:
        """Resume from the checkpoint (when asked and there is one), else start fresh: init_from's weights, if any."""
        invocation, trainer = self.settings.invocation, self.trainer
        resumed = None
        if invocation.resume:
            resumed = self.checkpoints.resume(chosen=invocation.resume_from, new_corpus=invocation.change_config)
        if resumed is not None:
            self.log(f"resuming at step {trainer.step_index}")
            return resumed
        if invocation.resume:  # a resume (or a restart) before the first checkpoint starts fresh: init_from included
            self.log("no checkpoint yet: starting from step 0")
        init_from = self.settings.trainer.train.init_from
        if init_from:
            from hydraulis.runtime.storage.hf_io import init_from as load_weights

            load_weights(trainer.optimizer, init_from)
            self.log(f"initialised from {init_from}")
        return None

    def _run_log(self) -> RunLog:
        start = self.trainer.step_index
        board = tensorboard(self.settings.out / "tb", start)
        return RunLog(settings=self.settings, start_step=start, tensorboard=board)

    def _watch(self, resumed: CheckpointInfo | None) -> RunFidelity | None:
        """Rank 0's watch over its predictions, which reads the load of the job's own processes (all ranks gather)."""
        pids: list[Any] = [os.getpid()] * self.env.world_size
        if self.env.world_size > 1:
            dist.all_gather_object(pids, os.getpid(), group=self.trainer.control)
        if self.env.rank != 0:
            return None
        return RunFidelity(settings=self.settings, trainer=self.trainer, pids=pids, threads=torch.get_num_threads(),
                           log=self.log, resumed=resumed)

    # -- the loop -----------------------------------------------------------------------------------
    def train(self) -> dict[str, Any] | None:
        """Resume (or start fresh), then train up to the invocation's end step or a stop; rank 0 returns the run
        summary."""
        resumed = self._start()
        self.run_log = self._run_log() if self.env.rank == 0 else None
        self.watch = self._watch(resumed)
        trainer, settings = self.trainer, self.settings
        try:
            while trainer.step_index < settings.end_step:
                metrics = trainer.step()  # the first one settles the groups' timeouts (Trainer.run_schedule)
                if self._after(metrics):
                    break
            else:
                self._end_of_schedule()
        finally:
            trainer.close()
            if self.run_log is not None:
                self.run_log.close()
        return self.run_log.finish(trainer.planner) if self.run_log is not None else None

    def _after(self, metrics: StepMetrics) -> bool:
        """Everything after a step: watch, evaluate, log, guard, checkpoint; whether the ranks agreed to stop."""
        measured = self.watch.after(metrics) if self.watch is not None else {}  # the load; maybe a refit
        evaluated = self._evaluate()  # every rank, when [eval] is due
        if self.run_log is not None:
            sources = self.corpus.source_counts(self.trainer.last_batch) if self._mixed else {}
            self.run_log.step(metrics, {**measured, **evaluated, **sources})
        # raises at the limit
        skipped = self.guard.check(metrics.step, metrics.loss, metrics.grad_norm, metrics.skipped)
        if skipped:
            self.log(skipped)
        stopping = self.stop.agreed(self.trainer)
        self.checkpoints.maybe_save(stopping, self.watch.refit.state() if self.watch is not None else None)
        if stopping:
            self.log(f"stopped by {self.stop.name} at step {self.trainer.step_index}; continue with --resume")
        return stopping

    @property
    def _mixed(self) -> bool:
        return self.settings.data.mixture is not None

    def _evaluate(self) -> dict[str, Any]:
        """The metrics of an evaluation now if `[eval]` is due (every rank runs it), else nothing."""
        held, step = self.settings.eval, self.trainer.step_index
        if held is None or not held.due(step, self.settings.steps):
            return {}
        result = evaluate(self.trainer, held.batches, held.plans, self.eval_corpus).to_dict()
        return {f"eval_{key}": value for key, value in result.items() if key != "step"}  # the row has the step

    def _end_of_schedule(self) -> None:
        """The invocation's last step: --stop-at's line, or the schedule's end and its measured comparison."""
        trainer, steps, train = self.trainer, self.settings.steps, self.settings.trainer.train
        if trainer.step_index < steps:
            self.log(f"stopped at step {trainer.step_index} (--stop-at) of {steps}; continue with --resume")
        elif train.compare_steps:
            self.log(f"measuring the last {len(trainer.recent)} batches again on each homogeneous deployment")
            comparison = trainer.compare(train.compare_repeats)
            if self.run_log is not None and comparison is not None:
                self.run_log.compared(comparison.to_dict())


def training_corpus(settings: RunSettings) -> IndexedCorpus | MixedCorpus:
    """The run's corpus as this rank reads it: the mixture's sources, or the one corpus."""
    mixture = settings.data.mixture
    return mixture.open() if mixture is not None else open_corpus(settings.data.corpus_path)


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

