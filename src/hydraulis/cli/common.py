"""Helpers shared by the command modules: output, errors, common options."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from hydraulis.errors import HydraulisError

if TYPE_CHECKING:
    from hydraulis.cost import CostModel
    from hydraulis.data.workload import Workload
    from hydraulis.specs import ClusterSpec

console = Console()
err_console = Console(stderr=True)

ProfileOption = typer.Option(
    "llama-7b@a800-80g",
    "--profile",
    "-p",
    help="Profile file, preset (llama-7b@a800-80g, ...) or MODEL@DEVICE for the analytic model.",
)


GpusPerNodeOption = typer.Option(8, "--gpus-per-node", help="GPUs per node.")
TokensPerBatchOption = typer.Option(None, "--tokens-per-batch", help="Histogram workloads: token budget.")
NumBatchesOption = typer.Option(None, "--num-batches", help="Histogram workloads: how many batches.")
SeedOption = typer.Option(None, "--seed", help="Histogram workloads: sampling seed.")


def load_job(
    profile: str,
    gpus: int,
    gpus_per_node: int,
    workload: Path,
    tokens_per_batch: int | None,
    num_batches: int | None,
    seed: int | None,
) -> tuple[CostModel, ClusterSpec, Workload]:
    """The cost model, cluster and workload that `plan` and `propose` start from, checked."""
    from hydraulis.cost import load_cost_model
    from hydraulis.data.workload import load_workload
    from hydraulis.specs import ClusterSpec

    if gpus < 1:
        raise HydraulisError(f"--gpus must be positive, got {gpus}")
    cluster = ClusterSpec(gpus, gpus_per_node)
    return load_cost_model(profile), cluster, load_workload(workload, tokens_per_batch, num_batches, seed)


def fail(message: str) -> NoReturn:
    """One line on stderr, exit code 2: the contract for bad input."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=1) + "\n")


def table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    t = Table(title=title, title_justify="left")
    for i, column in enumerate(columns):
        t.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*[str(x) for x in row])
    return t
