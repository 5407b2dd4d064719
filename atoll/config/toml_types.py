"""A TOML file's values against the settings' types: a mismatch is refused, never converted.

No torch and no strategy at import (the settings' catalog is read when a file is checked).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from atoll.config.applies import catalog
from atoll.config.runtimes import ServiceConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _scalar_kind(annotation: Any) -> type | None:
    """``int``, ``float`` or ``bool`` for a field of that type (or that type or None); else None."""
    import types
    import typing

    kinds = {annotation}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = {a for a in typing.get_args(annotation) if a is not type(None)}
    kind = kinds.pop() if len(kinds) == 1 else None
    return kind if kind in (int, float, bool) else None


def toml_type_error(table: dict[str, Any], path: Path | str) -> str | None:
    """The one-line error for the first value of a TOML file whose type does not fit its number or switch
    setting, else None.

    A flag is text by nature (pydantic converts ``--lr 1e-3``), but a TOML value has a type, and a mismatch is
    a mistake the file should not hide: a string for a number or a switch (``lr = "1e-3"``, ``compile =
    "yes"``, which pydantic would read as true), a float for a whole number (``seq_len = 32.0``), a number for
    a switch or a switch for a number. A whole number is a valid float (``lr = 1``). Keys that are not
    settings, and settings of other types (text, paths, lists), are left to the validation.
    """
    for key, value in table.items():
        field = catalog().get(key) or ServiceConfig.model_fields.get(key)  # (and atoll syncer's, island's)
        kind = _scalar_kind(field.annotation) if field is not None else None
        if kind is None:
            continue
        fits = isinstance(value, bool) if kind is bool else (
            type(value) is int if kind is int else type(value) in (int, float))
        if fits:
            continue
        want = {bool: "a switch (true or false)", int: "a whole number", float: "a number"}[kind]
        got = ("the string " + repr(value) if isinstance(value, str) else
               f"the switch value {str(value).lower()}" if isinstance(value, bool) else
               f"the float {value!r}" if isinstance(value, float) else f"the number {value}" if isinstance(value, int)
               else f"a TOML {type(value).__name__}")
        example = _toml_example(kind, value, field.default)
        return f"{key}: {got} in '{path}' is not {want}; write {key} = {example}" + (
            " (no quotes)" if isinstance(value, str) and not example.startswith("<") else "")
    return None


def _toml_example(kind: type, value: Any, default: Any) -> str:
    """The TOML text of ``value`` as a ``kind``, where it reads as one unambiguously; else a placeholder."""
    text = value.strip() if isinstance(value, str) else None
    if kind is bool:
        if text is not None and text.lower() in ("true", "false"):
            return text.lower()
        return "true or false"
    try:
        number = float(text) if text is not None else None if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        number = None
    if number is not None and math.isfinite(number) and (kind is float or number.is_integer()):
        if kind is int:
            return str(int(number))
        try:  # the user's own spelling where it is a TOML number ("1e-3"), else Python's ("0.001")
            if text is not None and type(tomllib.loads(f"x = {text}")["x"]) in (int, float):
                return text
        except tomllib.TOMLDecodeError:
            pass
        return repr(number)
    sample = default if isinstance(default, (int, float)) and not isinstance(default, bool) else 1
    return f"<{'a whole number' if kind is int else 'a number'}, e.g. {sample}>"
