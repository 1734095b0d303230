"""Benchmark scripts are not run in CI, but they must keep importing what exists."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.stem for p in BENCHMARKS])
def test_benchmark_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(path.parent))  # as running a script does: it imports its sibling helpers
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # as an import does (dataclasses look their module up)
    spec.loader.exec_module(module)
    if 'if __name__ == "__main__":' in path.read_text():  # a script; a helper module (peer_models) only imports
        assert callable(module.main)
