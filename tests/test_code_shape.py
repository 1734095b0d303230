"""The code base's size rules: no module over 450 lines, no function over 70, no folder over 15 modules.

A rule nothing checks drifts: a module once grew to 456 lines unnoticed."""

from __future__ import annotations

import ast
from collections import Counter

from cli_helpers import SRC

PACKAGE = SRC / "hydraulis"
BENCHMARKS = SRC.parent / "benchmarks"
MODULE_LINES, FUNCTION_LINES, FOLDER_MODULES = 450, 70, 15


def _sources(benchmarks: bool = True) -> dict[str, str]:
    """The package's modules by path inside it, and the benchmarks' (as benchmarks/NAME.py)."""
    found = {path.relative_to(PACKAGE).as_posix(): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    if benchmarks:
        found |= {f"benchmarks/{path.name}": path.read_text() for path in sorted(BENCHMARKS.glob("*.py"))}
    return found


def test_no_module_is_over_450_lines() -> None:
    over = {name: n for name, text in _sources().items() if (n := len(text.splitlines())) > MODULE_LINES}
    assert not over, f"modules over {MODULE_LINES} lines: {over}"


def test_no_function_is_over_70_lines() -> None:
    over = {
        f"{name}:{node.name}": node.end_lineno - node.lineno + 1
        for name, text in _sources().items()
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > FUNCTION_LINES
    }
    assert not over, f"functions over {FUNCTION_LINES} lines: {over}"


def test_no_folder_holds_over_15_modules() -> None:
    modules = [name for name in _sources(benchmarks=False) if not name.endswith(("__init__.py", "__main__.py"))]
    counts = Counter(name.rpartition("/")[0] for name in modules)
    over = {folder or "hydraulis": n for folder, n in counts.items() if n > FOLDER_MODULES}
    assert not over, f"folders over {FOLDER_MODULES} modules: {over}"
