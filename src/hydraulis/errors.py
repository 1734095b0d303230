"""The one error type that users see.

Anything raised as `HydraulisError` is a problem with the user's input or
configuration; the CLI prints its message on one line and exits with code 2.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class HydraulisError(ValueError):
    """Bad input, named together with what to do about it."""
