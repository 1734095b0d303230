"""Runtime tests need torch; without it (planner-only installs) they are not collected."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("torch") else ["test_*.py", "dist_*.py"]
