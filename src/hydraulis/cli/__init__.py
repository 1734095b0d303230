"""The `hydraulis` command.

Bad input prints one line and exits with code 2; an interruption one line and
130/143 (see common.run_app); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

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


def main() -> None:
    common.run_app(app)
