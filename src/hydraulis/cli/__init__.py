"""The `hydraulis` command.

User errors (HydraulisError) print one line and exit with code 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

from hydraulis.cli import common, data, foundation  # noqa: F401  (registers commands)
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
