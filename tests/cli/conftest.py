"""Fixtures the `hydraulis` command's tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small byte-level corpus of train_helpers.make_corpus, built once per test module."""
    from train_helpers import make_corpus

    return make_corpus(tmp_path_factory.mktemp("corpus") / "docs")
