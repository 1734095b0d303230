"""Files on disk: outputs checked before work, published atomically, read with one clear error.

A command's outputs are written to temporaries next to their targets and
renamed into place together (`OutputSet`); a whole directory (a corpus, a
checkpoint, an exported model) is built under a temporary name and swapped in
by `replace_directory`. Readers raise one HydraulisError that names the file.

The JSON file formats (docs/reference.md, File formats) are read and written here
too: every format carries a `schema` key, readers name the file and the
field that is wrong (`Fields`), and `write_json_atomic` publishes through
`OutputSet`, so a crash never leaves a half-written file behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hydraulis.errors import HydraulisError
from hydraulis.limits import INT64_MAX, finite, short_repr
from hydraulis.processes import interrupt


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


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file (none when it is missing); a line a crash cut short is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


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


# ---------------------------------------------------------------- JSON formats


def read_json_object(
    path: str | Path, missing: str = "no such file", expected: str = "a JSON object"
) -> dict[str, Any]:
    """A file holding one JSON object (finite numbers only), or a HydraulisError naming the file."""
    path = Path(path)
    text = read_text(path, missing)
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise HydraulisError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except ValueError as exc:  # NaN, Infinity, or an integer of more digits than Python parses
        raise HydraulisError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise HydraulisError(f"{path}: expected {expected}")
    return data


def load_json(path: str | Path, schema: str) -> dict[str, Any]:
    """A JSON file of one of our formats: an object whose `schema` key is `schema`."""
    data = read_json_object(path, expected=f"a JSON object with schema {schema!r}")
    found = data.get("schema")
    if found != schema:
        raise HydraulisError(f"{path}: schema is {found!r}, expected {schema!r}")
    return data


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows; give a finite value")


def write_json_atomic(path: str | Path, data: Any) -> None:
    """JSON through a temporary file and a rename: a crash or an interruption never leaves half a file."""
    with OutputSet() as outputs:
        tmp = outputs.stage(path)
        with tmp.open("w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1)
            fh.write("\n")


class Fields:
    """Typed access to one JSON object, with errors that say where."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise HydraulisError(f"{where}: expected an object, got {type(data).__name__}")
        self.data = data
        self.where = where

    def _get(self, key: str, default: Any) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _MISSING:
            raise HydraulisError(f"{self.where}: missing field {key!r}")
        return default

    def str(self, key: str, default: Any = None) -> str:
        value = self._get(key, _MISSING if default is None else default)
        if not isinstance(value, str):
            raise HydraulisError(f"{self.where}.{key}: expected a string, got {value!r}")
        return value

    def int(self, key: str, default: Any = None, minimum: int | None = None, maximum: int = INT64_MAX) -> int:
        value = self._get(key, _MISSING if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int):
            # 2.0 is 2; 1e30 is not an integer anyone meant (floats are exact only up to 2^53).
            if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
                value = int(value)
            else:
                raise HydraulisError(f"{self.where}.{key}: expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise HydraulisError(f"{self.where}.{key}: must be at least {minimum}, got {short_repr(value)}")
        if value > maximum:
            raise HydraulisError(f"{self.where}.{key}: must be at most {maximum}, got {short_repr(value)}")
        return value

    def float(self, key: str, default: Any = None, minimum: float | None = None) -> float:
        value = self._get(key, _MISSING if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not finite(value):
            raise HydraulisError(f"{self.where}.{key}: expected a finite number, got {short_repr(value)}")
        if minimum is not None and value < minimum:
            raise HydraulisError(f"{self.where}.{key}: must be at least {minimum}, got {value}")
        return float(value)

    def list(self, key: str, default: Any = None) -> list[Any]:
        value = self._get(key, _MISSING if default is None else default)
        if not isinstance(value, list):
            raise HydraulisError(f"{self.where}.{key}: expected a list, got {type(value).__name__}")
        return value

    def float_list(self, key: str, default: Any = None, minimum: float | None = None) -> list[float]:
        values = self.list(key, default)
        return [Fields({f"{key}[{i}]": v}, self.where).float(f"{key}[{i}]", minimum=minimum)
                for i, v in enumerate(values)]

    def obj(self, key: str) -> Fields:
        return Fields(self._get(key, _MISSING), f"{self.where}.{key}")

    def int_list(self, key: str, minimum: int | None = None, maximum: int = INT64_MAX) -> list[int]:
        values = self.list(key)
        out: list[int] = []
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int):
                raise HydraulisError(f"{self.where}.{key}[{i}]: expected an integer, got {short_repr(v)}")
            if minimum is not None and v < minimum:
                raise HydraulisError(f"{self.where}.{key}[{i}]: must be at least {minimum}, got {short_repr(v)}")
            if v > maximum:
                raise HydraulisError(f"{self.where}.{key}[{i}]: must be at most {maximum}, got {short_repr(v)}")
            out.append(v)
        return out


_MISSING = object()
