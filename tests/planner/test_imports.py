"""The package's modules depend one way, drawn from their own import statements (function-level ones too).

Layers, lowest first; a module may import its own layer and the ones below,
never one above. Inside a layer the imports form no circle either. Only the
runtime, the training loop that drives it and the checkpoints' torch half
import torch, so the planner, cost model, simulator and data work with numpy
and scipy alone.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import SRC

PACKAGE = SRC / "hydraulis"

# The checkpoints' torch half; its format half (manifest, resume, export_files) is torch-free, so the job checks a
# resume before any rank starts.
CHECKPOINTS_TORCH = tuple(f"hydraulis.checkpoints.{m}" for m in ("saver", "rng", "rundir", "export"))
# Module-name prefixes of each layer, lowest first (docs/design.md, section 9).
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "hydraulis",
        "hydraulis.errors",
        "hydraulis.limits",
        "hydraulis.progress",
        "hydraulis.specs",
        "hydraulis.plots",
        "hydraulis.files",
        "hydraulis.processes",
    ),
    ("hydraulis.parallel", "hydraulis.pipeline_order", "hydraulis.context", "hydraulis.optim", "hydraulis.families"),
    ("hydraulis.cost", "hydraulis.data"),
    ("hydraulis.planner",),
    ("hydraulis.baselines",),
    ("hydraulis.settings",),  # what a trainer runs, resolved before any rank starts (torch-free)
    # The runtime's sub-packages, each a layer: collectives and groups; the model; the optimizer's layout and
    # exchange; the runtime's own modules (pipeline, iteration, trainer, check, ...) with its meters, which measure
    # the step the trainer runs and the trainer reads (one layer, no circle of modules); storage.
    ("hydraulis.runtime.parallelism",),
    ("hydraulis.runtime.modeling",),
    ("hydraulis.runtime.optimizer",),
    ("hydraulis.runtime", "hydraulis.runtime.metering"),
    ("hydraulis.runtime.storage",),
    ("hydraulis.checkpoints",),  # saves the runtime's parts; the runtime never reads a checkpoint
    ("hydraulis.bench", "hydraulis.report", "hydraulis.training"),
    ("hydraulis.cli", "hydraulis.__main__"),
)
TORCH_ALLOWED = ("hydraulis.runtime", "hydraulis.training.loop", "hydraulis.training.run", *CHECKPOINTS_TORCH)


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module this one names in an import, absolute, wherever the statement sits."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}
EDGES = {name: {m for m in imported if m in MODULES and m != name} for name, imported in IMPORTS.items()}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or (prefix != "hydraulis" and name.startswith(prefix + "."))


def _layer(name: str) -> int:
    best = max(
        ((len(prefix), i) for i, layer in enumerate(LAYERS) for prefix in layer if _within(name, prefix)),
        default=None,
    )
    assert best is not None, f"{name} belongs to no layer: add it to LAYERS"
    return best[1]


def test_every_module_has_a_layer():
    for name in MODULES:
        _layer(name)


def test_no_import_goes_up_a_layer():
    upward = [
        f"{name} -> {target}" for name, targets in EDGES.items() for target in targets if _layer(target) > _layer(name)
    ]
    assert upward == []


def test_no_import_circle():
    circles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(EDGES[node]):
            if nxt == "hydraulis" or nxt == node.rpartition(".")[0]:
                continue  # a package's __init__ re-exporting its modules is not a dependency circle
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for name in MODULES:
        if name not in state:
            visit(name, [name])
    assert circles == []


def test_torch_only_in_the_runtime_and_the_loop():
    users = sorted(
        name
        for name, imported in IMPORTS.items()
        if any(m == "torch" or m.startswith("torch.") for m in imported)
        and not any(_within(name, prefix) for prefix in TORCH_ALLOWED)
    )
    assert users == []


def test_cli_is_on_top():
    assert [
        f"{n} -> {t}"
        for n, ts in EDGES.items()
        for t in ts
        if t.startswith("hydraulis.cli") and not (n.startswith("hydraulis.cli") or n == "hydraulis.__main__")
    ] == []


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("hydraulis.planner.schedule", ["hydraulis.planner.planner", "hydraulis.planner.policy"]),
        ("hydraulis.planner.planner", ["hydraulis.planner.policy", "hydraulis.planner.proposal", "torch"]),
        ("hydraulis.planner.proposal.propose", ["hydraulis.planner.policy", "torch"]),
        ("hydraulis.planner.policy", ["torch"]),
        ("hydraulis.bench", ["torch"]),
        ("hydraulis.training.config", ["torch"]),
        ("hydraulis.checkpoints.resume", ["torch"]),
    ],
)
def test_import_direction_at_run_time(module, absent):
    code = f"import sys, {module}; print([m for m in {absent!r} if m in sys.modules])"
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(SRC)}, check=True
    )
    assert res.stdout.strip() == "[]", res.stdout
