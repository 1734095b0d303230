from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="200")


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the real `hydraulis` command (this checkout's source) and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "hydraulis.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_env(),
        timeout=timeout,
    )


def start_cli(*args: str, cwd: Path | None = None) -> subprocess.Popen[str]:
    """Start the real command without waiting (to signal it); output unbuffered, so it can be followed."""
    return subprocess.Popen(
        [sys.executable, "-m", "hydraulis.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=dict(_env(), PYTHONUNBUFFERED="1"),
    )


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Built-in corpora go to a per-session cache, never the user's ~/.cache."""
    cache = tmp_path_factory.getbasetemp() / "hydraulis-cache"
    monkeypatch.setenv("HYDRAULIS_CACHE", str(cache))
    return cache
