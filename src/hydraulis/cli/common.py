"""Helpers shared by the command modules: output, errors, common options."""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)

ProfileOption = typer.Option(
    "llama-7b@a800-80g",
    "--profile",
    "-p",
    help="Profile file, preset (llama-7b@a800-80g, ...) or MODEL@DEVICE for the analytic model.",
)


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
