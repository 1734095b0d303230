"""`hydraulis profile`: measure the runtime here, fit the cost model, write a `hydraulis.profile/1` file."""

from __future__ import annotations

from pathlib import Path

import typer

from hydraulis.cli.app import app
from hydraulis.cli.common import console, table
from hydraulis.cost.sweep import ProfileSettings

DEFAULT = ProfileSettings()  # the options' defaults: written once, in the settings record


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


def _ints(text: str, what: str) -> tuple[int, ...]:
    from hydraulis.errors import HydraulisError

    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise HydraulisError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values:
        raise HydraulisError(f"{what}: no values")
    return values


@app.command()
def profile(
    model: str = typer.Option(..., "--model", "-m", help="Model preset (tiny, small, llama-7b, ...)."),
    configs: str = typer.Option(..., "--configs", "-c", help="Parallel configs, e.g. tp1pp1,tp2pp1,tp1pp2."),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the hydraulis.profile/1 file."),
    nproc: int = typer.Option(None, "--nproc", "-n", help="Processes (default: the largest config's size)."),
    device: str = typer.Option("cpu", "--device", help="cpu (gloo) or cuda (NCCL, one GPU per process)."),
    name: str = typer.Option(None, "--name", help="Profile name (default MODEL@DEVICE-measured)."),
    totals: str = typer.Option(_csv(DEFAULT.totals), "--totals", help="Sweep: tokens per micro-batch."),
    min_doc: int = typer.Option(DEFAULT.min_doc, "--min-doc", help="Sweep: shortest document."),
    max_doc: int = typer.Option(DEFAULT.max_doc, "--max-doc", help="Sweep: longest document."),
    warmup: int = typer.Option(DEFAULT.warmup, "--warmup", help="Untimed runs of each micro-batch first."),
    repeats: int = typer.Option(
        DEFAULT.repeats, "--repeats", help="Timed runs of each micro-batch (the median counts)."
    ),
    interleave: bool = typer.Option(
        DEFAULT.interleave,
        "--interleave/--one-config-at-a-time",
        help="Configs take turns by rounds (holds all models at once).",
    ),
    threads: int = typer.Option(None, "--threads", help="torch threads per rank (default: cores / processes)."),
    load_retries: int = typer.Option(
        DEFAULT.load_retries, "--load-retries", help="Times a round timed under other processes' load runs again."
    ),
    dtype: str = typer.Option(None, "--dtype", help="fp32 or bf16 (default: fp32 on cpu, bf16 on cuda)."),
    collective_bytes: str = typer.Option(
        _csv(DEFAULT.collective_bytes), "--collective-bytes", help="Collective sizes: bytes each rank sends."
    ),
) -> None:
    """Time forward+backward per stage on this machine, fit a, b, c per config, and check the fit on held-out points."""
    from hydraulis.errors import HydraulisError
    from hydraulis.specs import get_model

    spec = get_model(model)
    settings_kwargs = dict(
        totals=_ints(totals, "--totals"),
        min_doc=min_doc,
        max_doc=max_doc,
        warmup=warmup,
        repeats=repeats,
        dtype=dtype,
        threads=threads,
        interleave=interleave,
        load_retries=load_retries,
        collective_bytes=_ints(collective_bytes, "--collective-bytes"),
    )
    if out.is_dir():
        raise HydraulisError(f"--out {out} is a directory")
    from hydraulis.cost.sweep import check_configs, parse_config_list

    settings = ProfileSettings(**settings_kwargs)
    chosen = parse_config_list(configs)
    check_configs(spec, chosen, nproc, device)
    # torch only now: bad input above fails fast, without it.
    from hydraulis.files import write_json_atomic
    from hydraulis.runtime.metering.profiler import check_job, profile_model, progress_steps

    world = check_job(spec, chosen, nproc, device)
    from hydraulis.progress import steps_progress

    total = progress_steps(chosen, settings, world)
    with steps_progress(f"profiling {spec.name} on {world} process(es)", total) as step:
        data = profile_model(spec, chosen, nproc=world, device=device, settings=settings, name=name, progress=step)
    write_json_atomic(out, data)
    _print_profile(data, out, len(chosen))


def _print_profile(data: dict, out: Path, configs: int) -> None:
    """What a profile found: coefficients and held-out errors, links, memory method, load, time."""
    from hydraulis.cost.measured import load_line, summary_rows

    columns_ = ["config", "a ms/tok^2", "b ms/tok", "c ms", "fit median", "held-out median", "held-out worst"]
    console.print(table(f"{data['name']}: fitted per-stage forward+backward -> {out}", columns_, summary_rows(data)))
    coll = data.get("collectives", {})
    for key, label in (("all_to_all", "all-to-all (optimizer gather/reduce)"), ("p2p", "p2p (pipeline)")):
        if key in coll:
            link = coll[key]
            console.print(
                f"{label}: latency {link['latency_s'] * 1e6:.0f} us, bandwidth {link['bandwidth_Bps'] / 1e9:.2f} GB/s"
            )
    console.print(f"memory: {data['memory']['method']}")
    load = load_line(data)
    if load:
        console.print(load, highlight=False)
    console.print(
        f"held-out third of {len(data['measurements']['points']) // configs} micro-batches per config; "
        f"{data['measurements']['wall_s']:.0f} s"
    )
