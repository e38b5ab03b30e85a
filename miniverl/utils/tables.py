"""Nested report and config values as dotted keys, and as text in the cells of a console or
markdown table (no heavy imports: the sweep-summary callback loads this at Hydra start-up)."""

from __future__ import annotations

import json


def format_value(value, *, null: str = "null", digits: int = 6) -> str:
    """A report value as text in a table cell."""
    if value is None:
        return null
    if isinstance(value, float):  # whole digits past `digits` are kept: 55870, not 5.587e+04
        text = f"{value:.{digits}g}"
        return f"{value:.0f}" if "e+" in text else text
    if isinstance(value, list):
        return json.dumps(value)
    return str(value)


def flatten(value, prefix: str = "") -> dict:
    """{"a.b.c": leaf} for a nested dict; an empty dict is a leaf of its own."""
    if isinstance(value, dict) and value:
        out = {}
        for key, sub in value.items():
            out.update(flatten(sub, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}
