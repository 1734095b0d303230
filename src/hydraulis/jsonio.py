"""Reading and writing the JSON file formats (docs/design.md, section 8) with clear errors.

Every format carries a `schema` key. Readers name the file and the field that
is wrong; writers publish through files.OutputSet, so a crash never leaves a
half-written file behind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydraulis.errors import HydraulisError
from hydraulis.files import OutputSet, read_text
from hydraulis.limits import INT64_MAX, finite, short_repr


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
