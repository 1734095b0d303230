"""The planner's modules depend one way (policy -> proposal -> planner -> schedule) and never on torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cli_helpers import SRC


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("hydraulis.planner.schedule", ["hydraulis.planner.planner", "hydraulis.planner.policy"]),
        ("hydraulis.planner.planner", ["hydraulis.planner.policy", "hydraulis.planner.proposal", "torch"]),
        ("hydraulis.planner.proposal", ["hydraulis.planner.policy", "torch"]),
        ("hydraulis.planner.policy", ["torch"]),
    ],
)
def test_import_direction(module, absent):
    code = f"import sys, {module}; print([m for m in {absent!r} if m in sys.modules])"
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(SRC)}, check=True
    )
    assert res.stdout.strip() == "[]", res.stdout
