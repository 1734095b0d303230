"""docs/design.md's package map names every module of src/hydraulis, in its folder's entry, and no module that is gone.

The map is the code block of section 9: an entry starts at indent 2 (a top-level folder or top-level files) or
4 (a sub-package of the folder above it), and its continuation lines are indented further. Every module is named
in its folder's entry as `stem.py`; top-level modules in the entries that start with a file.
"""

from __future__ import annotations

import re

from cli_helpers import SRC

PACKAGE = SRC / "hydraulis"
DESIGN = SRC.parent / "docs" / "design.md"
NAME = re.compile(r"(?<![\w/.])([A-Za-z_]\w*)\.py\b")


def _map_block(text: str) -> list[str]:
    """The lines of the first code block after the package map's heading."""
    section = text.split("## 9. Package map", 1)[1]
    return section.split("```", 2)[1].splitlines()[1:]


def _entries(lines: list[str]) -> dict[str, str]:
    """Folder ('' for the top level, 'runtime/modeling/' for a sub-package) -> the text of its entries."""
    entries: dict[str, str] = {}
    top, current = "", ""
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent > 4 or indent < 2:
            entries[current] = entries.get(current, "") + " " + line
            continue
        head = line.split()[0]
        if head.endswith("/"):
            current = head if indent == 2 else top + head
            top = head if indent == 2 else top
        else:
            current = ""
        entries[current] = entries.get(current, "") + " " + line
    return entries


def _modules() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        folder = path.parent.relative_to(PACKAGE).as_posix()
        found.setdefault("" if folder == "." else folder + "/", set()).add(path.stem)
    return found


def test_every_module_is_in_its_folders_entry_and_every_name_exists() -> None:
    entries = _entries(_map_block(DESIGN.read_text()))
    modules = _modules()
    missing = sorted(
        f"{folder}{stem}.py"
        for folder, stems in modules.items()
        for stem in stems
        if stem not in set(NAME.findall(entries.get(folder, "")))
    )
    assert not missing, f"docs/design.md section 9 does not name: {', '.join(missing)}"
    stale = sorted(
        f"{folder}{stem}.py"
        for folder, text in entries.items()
        for stem in NAME.findall(text)
        if stem not in modules.get(folder, set())
    )
    assert not stale, f"docs/design.md section 9 names modules that do not exist: {', '.join(stale)}"


def test_a_name_deleted_from_the_map_is_caught() -> None:
    """The check reads the map it is given: without `sim.py` the planner's entry misses it."""
    lines = _map_block(DESIGN.read_text())
    entries = _entries([line.replace("sim.py", "sim") for line in lines])
    assert "sim" not in NAME.findall(entries["planner/"])
    assert "sim" in _modules()["planner/"]
