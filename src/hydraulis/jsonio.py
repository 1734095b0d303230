"""Reading and writing the JSON file formats (DESIGN section 6) with clear errors.

Every format carries a `schema` key. Readers name the file and the field that
is wrong; writers go through a temporary file and a rename, so a crash never
leaves a half-written file behind.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from hydraulis.errors import HydraulisError


def load_json(path: str | Path, schema: str) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HydraulisError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HydraulisError(f"{path}: cannot read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HydraulisError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise HydraulisError(f"{path}: expected a JSON object with schema {schema!r}")
    found = data.get("schema")
    if found != schema:
        raise HydraulisError(f"{path}: schema is {found!r}, expected {schema!r}")
    return data


def default_mode(path: str | Path) -> None:
    """mkstemp/mkdtemp make private (0600/0700) entries; published files get the usual umask-based mode."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~umask)


def write_json_atomic(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1)
            fh.write("\n")
        default_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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

    def int(self, key: str, default: Any = None, minimum: int | None = None) -> int:
        value = self._get(key, _MISSING if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise HydraulisError(f"{self.where}.{key}: expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise HydraulisError(f"{self.where}.{key}: must be at least {minimum}, got {value}")
        return value

    def float(self, key: str, default: Any = None, minimum: float | None = None) -> float:
        value = self._get(key, _MISSING if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise HydraulisError(f"{self.where}.{key}: expected a finite number, got {value!r}")
        if minimum is not None and value < minimum:
            raise HydraulisError(f"{self.where}.{key}: must be at least {minimum}, got {value}")
        return float(value)

    def list(self, key: str, default: Any = None) -> list[Any]:
        value = self._get(key, _MISSING if default is None else default)
        if not isinstance(value, list):
            raise HydraulisError(f"{self.where}.{key}: expected a list, got {type(value).__name__}")
        return value

    def obj(self, key: str) -> Fields:
        return Fields(self._get(key, _MISSING), f"{self.where}.{key}")

    def int_list(self, key: str, minimum: int | None = None) -> list[int]:
        values = self.list(key)
        out: list[int] = []
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int):
                raise HydraulisError(f"{self.where}.{key}[{i}]: expected an integer, got {v!r}")
            if minimum is not None and v < minimum:
                raise HydraulisError(f"{self.where}.{key}[{i}]: must be at least {minimum}, got {v}")
            out.append(v)
        return out


_MISSING = object()
