from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Built-in corpora go to a per-session cache, never the user's ~/.cache."""
    cache = tmp_path_factory.getbasetemp() / "hydraulis-cache"
    monkeypatch.setenv("HYDRAULIS_CACHE", str(cache))
    return cache
