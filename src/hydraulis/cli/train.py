"""`hydraulis train`: train a model on a corpus with heterogeneous replicas that switch between iterations."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from hydraulis.cli.app import app


@app.command()
def train(
    config: Path = typer.Option(..., "--config", "-c", help="The run config (TOML); see examples/tiny-cpu.toml."),
    nproc: int = typer.Option(None, "--nproc", help="Local gloo processes to spawn (default: the pool's GPUs)."),
    out: str = typer.Option(None, "--out", "-o", help="Run directory (default: train.out of the config)."),
    steps: int = typer.Option(None, "--steps", help="The LR schedule's length in steps (default: train.steps)."),
    stop_at: int = typer.Option(
        None, "--stop-at", help="Stop (and save) at step K, keeping the schedule; continue later with --resume."
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its newest checkpoint."),
    change_schedule: bool = typer.Option(
        False, "--change-schedule", help="With --resume: accept another LR schedule than the checkpoint's."
    ),
    change_config: bool = typer.Option(
        False, "--change-config",
        help="With --resume: accept a config whose [data], [model], [parallel] or [optim] differs from the run's.",
    ),
    max_restarts: int = typer.Option(
        0, "--max-restarts", help="Local runs: after a rank fails, restart this often from the last checkpoint."
    ),
) -> None:
    """Train; under torchrun every process is one rank, without it --nproc local gloo ranks are spawned."""
    from hydraulis.errors import HydraulisError
    from hydraulis.processes import interrupt, rank_server
    from hydraulis.progress import keep_going, say, transcribe
    from hydraulis.training.config import load_config, naming_file, start_notes
    from hydraulis.training.job import prepare, torchrun_world

    keep_going()  # a closed terminal or pipe (`| tee` killed by Ctrl-C, `| head`) must not stop the run
    if steps is not None and steps < 1:
        raise HydraulisError(f"--steps must be positive, got {steps}")
    if max_restarts < 0:
        raise HydraulisError(f"--max-restarts must be non-negative, got {max_restarts}")
    if change_schedule and not resume:
        raise HydraulisError("--change-schedule needs --resume: a new run has no schedule to change")
    if change_config and not resume:
        raise HydraulisError("--change-config needs --resume: a new run has no config to change")
    try:
        run_config = load_config(config)
        settings = prepare(
            run_config, nproc=nproc, out=out, steps=steps, resume=resume, max_restarts=max_restarts,
            stop_at=stop_at, change_schedule=change_schedule, change_config=change_config,
        )
    except HydraulisError as exc:
        raise HydraulisError(naming_file(str(exc), config)) from None
    if torchrun_world() is None or os.environ.get("RANK") == "0":  # where a default matters: one line each
        transcribe(settings.transcript)  # the lines said so far, and every later one
        interrupt.keep(f"{settings.transcript} (the run's log)")
        for line in start_notes(run_config, settings.steps):
            say(line)
    if settings.world > 1 and torchrun_world() is None:
        rank_server.start()  # its import of torch runs beside the launcher's, next
    from hydraulis.training.loop import run  # torch only now: bad input above fails fast, without it

    run(settings)
