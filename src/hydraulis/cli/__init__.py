"""The `hydraulis` command.

User errors (HydraulisError) print one line and exit with code 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

# Each command module registers its commands on import; one per line keeps merges clean.
from hydraulis.cli import (
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
from hydraulis.errors import HydraulisError


def main() -> None:
    try:
        app()
    except HydraulisError as exc:
        common.fail(str(exc))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
