from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import SRC, run_cli, start_cli  # noqa: F401


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def session_cli():
    """`run_cli` for module-scoped fixtures (one expensive run shared by several tests)."""
    return run_cli


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Built-in corpora go to a per-session cache, never the user's ~/.cache."""
    cache = tmp_path_factory.getbasetemp() / "hydraulis-cache"
    monkeypatch.setenv("HYDRAULIS_CACHE", str(cache))
    return cache
