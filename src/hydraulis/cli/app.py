"""The typer application that every command module registers on."""

from __future__ import annotations

import sys

import typer

from hydraulis.progress import UNWRAPPED

_TERMINAL = sys.stdout.isatty()

app = typer.Typer(
    name="hydraulis",
    help="Plan, simulate and run training on variable-length data with heterogeneous parallel replicas.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="rich" if _TERMINAL else None,
    context_settings={} if _TERMINAL else {"max_content_width": UNWRAPPED, "terminal_width": UNWRAPPED},
)
