"""Atomic corpus builds: hidden temporary directories next to the target, swept when their builder died.

A build writes into `.NAME.XXXX.tmp` next to the corpus and renames it into
place when complete; the directory holds the builder's pid (`.owner`, and its name), so the
next build in that directory, whatever it builds, removes the leftovers of a
builder that is gone (SIGKILL, power loss) and spares those of one still
running. `cache_dir` is where built-in corpora and sources named in a run
config are built.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from hydraulis.files import default_mode, temp_prefix


def cache_dir() -> Path:
    """Where built corpora are kept: $HYDRAULIS_CACHE, else ~/.cache/hydraulis."""
    env = os.environ.get("HYDRAULIS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "hydraulis"


OWNER_FILE = ".owner"  # the building process's id, inside each temporary directory


def temp_dir(out: Path, suffix: str) -> Path:
    """`.NAME.PID-XXXX.tmp` (or `.old`) next to `out`, marked with our pid so that sweeps spare it while we live.

    The pid is in the name too: a builder killed between making the directory and writing `.owner` still
    leaves a mark that any later build can read."""
    prefix = f"{temp_prefix(out.name)}{os.getpid()}-"
    tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=out.parent))
    (tmp / OWNER_FILE).write_text(str(os.getpid()))
    return tmp


def sweep_temporaries(out: Path) -> int:
    """Remove the temporary directories whose builder is gone (SIGKILL, power loss) next to `out`: those of
    builds of `out`, and those of any other corpus build there (known by their `.owner` mark)."""
    swept = 0
    mine = temp_prefix(out.name)
    for p in out.parent.glob(".*"):
        if p.suffix not in (".tmp", ".old") or not p.is_dir() or p.is_symlink():
            continue
        pid = _owner(p)
        if (pid is not None and _alive(pid)) or (pid is None and not p.name.startswith(mine)):
            continue
        shutil.rmtree(p, ignore_errors=True)
        swept += not p.exists()
    return swept


def _owner(tmp: Path) -> int | None:
    """The builder's pid: from `.owner`, else from the name; None for an unmarked directory (only a build of
    the same corpus can tell it is its own, by the name)."""
    try:
        return int((tmp / OWNER_FILE).read_text())
    except (OSError, ValueError):
        named = re.search(r"\.(\d+)-\w+\.(?:tmp|old)$", tmp.name)
        return int(named.group(1)) if named else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return True


def default_permissions(tmp: Path) -> None:
    """A corpus directory and its files get the usual umask-based modes."""
    default_mode(tmp)
    for p in tmp.iterdir():
        default_mode(p)


def occupied(out: Path) -> bool:
    """An existing non-empty directory (an empty one, e.g. made by the user beforehand, is fair game)."""
    return out.is_dir() and any(out.iterdir())
