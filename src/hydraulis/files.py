"""Files on disk: outputs checked before work, published atomically, read with one clear error.

A command's outputs are written to temporaries next to their targets and
renamed into place together (`OutputSet`); a whole directory (a corpus, a
checkpoint, an exported model) is built under a temporary name and swapped in
by `replace_directory`. Readers raise one HydraulisError that names the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from hydraulis import interrupt
from hydraulis.errors import HydraulisError


def not_found(path: str | Path, what: str = "no such file") -> str:
    """The message for a path that is not there: the absolute path tried, so it says where it looked (a
    relative path, in a config too, is relative to the current directory, as in torchrun and transformers)."""
    path = Path(path)
    relative = "" if path.is_absolute() else "; a relative path is read from the current directory"
    return f"{path.absolute()}: {what}{relative}"


def read_text(path: str | Path, missing: str = "no such file") -> str:
    """A UTF-8 text file, or a HydraulisError naming it (`missing` says what its absence means)."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HydraulisError(not_found(path, missing)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HydraulisError(f"{path}: cannot read: {exc}") from None


def sha256_file(path: Path) -> str:
    """The file's SHA-256, read in 1 MiB blocks (FileNotFoundError if it is gone)."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def default_mode(path: str | Path) -> None:
    """mkstemp/mkdtemp make private (0600/0700) entries; published files get the usual umask-based mode."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~umask)


def temp_prefix(name: str) -> str:
    """`.NAME.` for temporaries next to NAME, short enough that the temporary's name fits wherever NAME fits."""
    return f".{name[:96]}."


def check_output(path: str | Path, what: str = "output") -> Path:
    """Refuse, before any work, an output path that cannot be written: a directory, under a file, a name
    too long for the file system, or in a directory without write permission."""
    path = Path(path)
    _check_parents(path, what)
    if path.is_dir():
        raise HydraulisError(f"{path}: is a directory; the {what} needs a file name")
    return path


def check_output_dir(path: str | Path, what: str = "output directory") -> Path:
    """Like check_output, for a directory that a command fills (it may exist already)."""
    path = Path(path)
    _check_parents(path, what)
    if path.exists() and not path.is_dir():
        raise HydraulisError(f"{path}: exists and is not a directory; the {what} must be one")
    if path.exists() and not os.access(path, os.W_OK | os.X_OK):
        raise HydraulisError(f"{path}: no permission to write in it; choose another {what}")
    return path


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long, for one
        return False


def _check_parents(path: Path, what: str) -> None:
    """Names that fit, an ancestor that is a writable directory (the path itself may or may not exist)."""
    missing = []
    ancestor = path.absolute()
    while not _exists(ancestor):
        missing.append(ancestor)
        ancestor = ancestor.parent
    try:
        name_max = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    for p in missing:
        size = len(os.fsencode(p.name))
        if size > name_max:
            raise HydraulisError(
                f"{p.name[:40]}...: a name of {size} bytes, more than the {name_max} this file system allows; "
                f"use a shorter {what} name"
            )
    if ancestor == path.absolute():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise HydraulisError(f"{path}: {ancestor} is a file, not a directory; choose another {what} path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise HydraulisError(f"{path}: no permission to write in {ancestor}; choose another {what} path")


class OutputSet:
    """The files one command writes: published together when the `with` block succeeds, else none.

    `stage(target)` returns a temporary path next to the target (same suffix) to
    write to. Leaving the block normally renames every temporary into place
    with SIGINT/SIGTERM held back, so the set never appears half; an exception
    (interruption included) removes the temporaries and the directories the set
    created.
    """

    def __init__(self) -> None:
        self._staged: list[tuple[Path, Path]] = []
        self._made: list[Path] = []

    def __enter__(self) -> OutputSet:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._discard()
            return
        try:
            with interrupt.held():
                for tmp, target in self._staged:
                    default_mode(tmp)
                    os.replace(tmp, target)
                self._staged.clear()
        except BaseException:
            self._discard()
            raise

    def directory(self, path: str | Path) -> Path:
        """Create `path` (and missing parents), to be removed again if the set is discarded."""
        path = Path(path)
        check_output_dir(path)
        missing = []
        p = path
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            d.mkdir()
            self._made.append(d)
        return path

    def stage(self, target: str | Path) -> Path:
        target = check_output(target)
        self.directory(target.parent)
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(target.name), suffix=".tmp" + target.suffix, dir=target.parent)
        os.close(fd)
        self._staged.append((Path(tmp), target))
        return Path(tmp)

    def _discard(self) -> None:
        for tmp, _ in self._staged:
            tmp.unlink(missing_ok=True)
        self._staged.clear()
        for d in reversed(self._made):
            with contextlib.suppress(OSError):  # not empty: something else wrote there meanwhile
                d.rmdir()
        self._made.clear()


def write_text_atomic(path: str | Path, text: str) -> None:
    """Text through a temporary file and a rename: a crash or an interruption never leaves half a file."""
    with OutputSet() as outputs:
        outputs.stage(path).write_text(text, encoding="utf-8")


def replace_directory(tmp: Path, out: Path, old: Path | None = None) -> None:
    """Publish the finished directory `tmp` as `out` by renames; readers see the old one or the new one.

    An existing `out` is moved aside into `old` (an empty directory next to
    it; a hidden `.NAME.XXXX.old` when None), put back if the swap fails, and
    removed with `old`.
    """
    if not out.exists():
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return
    if old is None:
        old = Path(tempfile.mkdtemp(prefix=temp_prefix(out.name), suffix=".old", dir=out.parent))
    os.replace(out, old / out.name)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old / out.name, out)  # put the previous one back
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
