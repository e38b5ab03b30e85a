"""Hydra's override grammar (`key=value` lines) and the verl config a set of overrides builds: one
spelling of verl's values shared by the export's writer, the import's reader and the run-time checks,
without verl installed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from miniverl.utils.overrides import hydra_value
from miniverl.verl_compat.defaults import verl_defaults


def override_line(key: str, value: Any) -> str:
    return f"{key}={hydra_value(value)}"


def get(cfg: Mapping, dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def nested(flat: Mapping[str, Any]) -> dict:
    """{"a.b": 1} -> {"a": {"b": 1}}."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if isinstance(node.get(leaf), dict) and isinstance(value, Mapping):
            node[leaf].update(copy.deepcopy(dict(value)))
        else:
            node[leaf] = copy.deepcopy(value)
    return out


def virtual_verl_config(overrides: Mapping[str, Any], version: str) -> dict:
    """verl `version`'s defaults for the keys in VERL_DEFAULTS with `overrides` applied, interpolated the
    way verl's YAML interpolates them: what the run-time checks read, without verl installed."""
    from omegaconf import OmegaConf

    merged = {**verl_defaults(version), **overrides}
    return OmegaConf.to_container(OmegaConf.create(nested(merged)), resolve=True)
