"""The typer application that every command module registers on."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="hydraulis",
    help="Plan, simulate and run training on variable-length data with heterogeneous parallel replicas.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
