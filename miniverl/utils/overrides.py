"""Hydra's override grammar: a value written as `key=<value>` so that it parses back to itself (the
export's and the import's lines, the settings a refused resume needs), and the key a line sets."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

_SAFE = re.compile(r"^[A-Za-z0-9_./\-+@%]+$")  # not ~: Hydra reads it as a deletion
_RESERVED = {"true", "false", "null", "inf", "nan", "-inf", "+inf"}


def override_key(override: str) -> str:
    """The config key an override line names: `a.b` for `a.b=1`, `+a.b=1`, `++a.b=1` and `~a.b`."""
    return override.split("=", 1)[0].lstrip("+~")


def shell_override(key: str, value: Any) -> str:
    """`key=value` as one shell word, as the lines that say what to run print it (a folder with a space in
    its name stays one word; Hydra reads the space as part of the value)."""
    return shlex.quote(f"{key}={value}")


def hydra_value(value: Any) -> str:
    """A value in Hydra's override grammar that parses back to exactly `value`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        text = repr(value)
        return text if ("." in text or "e" in text or "n" in text) else text + ".0"
    if isinstance(value, str):
        if _SAFE.match(value) and value.lower() not in _RESERVED and not looks_numeric(value):
            return value
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as a Hydra override value")


def looks_numeric(text: str) -> bool:
    """Whether Hydra's grammar reads `text` as a number (1, 1e-4, inf), not a string."""
    try:
        float(text)
    except ValueError:
        return False
    return True
