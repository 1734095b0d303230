"""The `hydraulis` command.

Bad input prints one line and exits with code 2; an interruption one line and
130/143 (see common.run_app); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from typing import NoReturn

# Each command module registers its commands on import; one per line keeps merges clean.
from hydraulis.cli import (
    check,  # noqa: F401
    common,  # noqa: F401
    data,  # noqa: F401
    demo,  # noqa: F401
    export,  # noqa: F401
    foundation,  # noqa: F401
    plan,  # noqa: F401
    profile,  # noqa: F401
    propose,  # noqa: F401
    train,  # noqa: F401
)
from hydraulis.cli.app import app
from hydraulis.processes import leave


def main() -> NoReturn:
    """The command, as the process's whole work: once it and every atexit function are done, the process leaves
    without finalizing the interpreter (`processes.leave`; `common.run_app` alone, for a caller that goes on)."""
    leave.after_atexit()  # before the command imports what registers atexit functions: so it runs after them
    try:
        common.run_app(app)
    except SystemExit as exc:
        leave.ending(exc.code)
        raise
