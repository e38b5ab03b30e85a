"""verl's own config tree and dataclass sources as the oracle of the export tests, for each release:
verl 0.8.0 installed without its dependencies (`pip install --no-deps "verl==0.8.0"`), verl 0.9.1
beside it in `<venv>/verl-0.9.1` (`pip install --no-deps --target .venv/verl-0.9.1 "verl==0.9.1"`;
the README's test command does both). Only the config tree (verl/trainer/config, shipped as data) and
the source text are read; no verl module is imported.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from functools import cache
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

INSTALL = {
    "0.8.0": '.venv/bin/pip install --no-deps "verl==0.8.0"',
    "0.9.1": '.venv/bin/pip install --no-deps --target .venv/verl-0.9.1 "verl==0.9.1"',
}


def verl_tree(version: str) -> Path:
    """The `verl` package folder of `version` (its config tree and sources), or a failed test saying how
    to install it."""
    if version == "0.8.0":
        spec = importlib.util.find_spec("verl")  # finds the package without running its __init__
        root = Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None
    else:
        root = Path(sys.prefix) / f"verl-{version}" / "verl"
    found = None if root is None else next(root.parent.glob("verl-*.dist-info"), None)
    if found is None or not found.name.startswith(f"verl-{version}"):
        pytest.fail(f"verl {version} is not installed for the tests (found {found}): {INSTALL[version]}")
    return root


def compose_verl(root: Path, lines: list[str]):
    """verl's `ppo_trainer` config with the overrides, through Hydra's compose API (an unknown key fails)."""
    with initialize_config_dir(config_dir=str(root / "trainer" / "config"), version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(lines))


@cache
def verl_dataclasses(root: Path) -> dict[str, tuple[list[str], dict[str, str], dict[str, ast.expr]]]:
    """{class name: (bases, {field: annotation}, {field: default expression})} of verl's config
    dataclasses, from their source text."""
    files = [
        *(root / "workers" / "config").glob("*.py"),
        *(root / "trainer" / "config").glob("*.py"),
        root / "base_config.py",
        root / "utils" / "profiler" / "config.py",
    ]
    classes = {}
    for path in files:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                classes[node.name] = (
                    [ast.unparse(b).split(".")[-1] for b in node.bases],
                    {s.target.id: ast.unparse(s.annotation) for s in fields},
                    {s.target.id: s.value for s in fields if s.value is not None},
                )
    return classes


def annotation_of(classes, cls: str, name: str) -> str | None:
    bases, fields, _ = classes.get(cls, ([], {}, {}))
    if name in fields:
        return fields[name]
    for base in bases:
        found = annotation_of(classes, base, name)
        if found is not None:
            return found
    return None


def conforms(classes, annotation: str, value) -> bool:
    """Does `value` (as Hydra parsed it) fit verl's annotation, as OmegaConf would accept it when
    verl turns the node into its dataclass?"""

    def check(node: ast.expr, v) -> bool:
        if isinstance(node, ast.Constant):
            return check(ast.parse(node.value, mode="eval").body, v) if isinstance(node.value, str) else v is node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return check(node.left, v) or check(node.right, v)
        if isinstance(node, ast.Subscript):
            outer = ast.unparse(node.value).split(".")[-1]
            args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if outer == "Optional":
                return v is None or check(args[0], v)
            if outer == "Union":
                return any(check(a, v) for a in args)
            if outer in ("list", "List"):
                return isinstance(v, list) and all(check(args[0], x) for x in v)
            if outer in ("tuple", "Tuple"):
                return isinstance(v, list)
            if outer in ("dict", "Dict"):
                return isinstance(v, dict)
            return True
        name = ast.unparse(node).split(".")[-1]
        if name == "bool":
            return isinstance(v, bool)
        if name == "int":
            return isinstance(v, int) and not isinstance(v, bool)
        if name == "float":
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        if name == "str":
            return isinstance(v, str)
        if name in ("dict", "Dict"):
            return isinstance(v, dict)
        if name in ("list", "List", "tuple"):
            return isinstance(v, list)
        if name in classes:  # a nested config dataclass
            return isinstance(v, dict)
        return True  # Any, enums, ...

    return check(ast.parse(annotation, mode="eval").body, value)


def type_errors(root: Path, raw_default: dict, lines: list[str]) -> list[str]:
    """Every override whose value does not fit the type verl gives its key: the annotation of the
    verl dataclass the key's node is built into (its `_target_`), and the type of verl's YAML default."""
    classes = verl_dataclasses(root)
    errors = []
    for override in OverridesParser.create().parse_overrides(lines):
        key, value = override.key_or_group, override.value()
        node, owner, rest = raw_default, None, key.split(".")
        for k, part in enumerate(key.split(".")):
            if isinstance(node, dict) and "_target_" in node:
                owner, rest = node["_target_"].split(".")[-1], key.split(".")[k:]
            node = node.get(part) if isinstance(node, dict) else None
        annotation = None
        while owner is not None and rest:
            annotation = annotation_of(classes, owner, rest[0])
            owner = annotation if annotation in classes else None
            rest = rest[1:]
        if annotation is not None and not rest:
            if not conforms(classes, annotation, value):
                errors.append(f"{key}={value!r} is not {annotation} (verl's dataclass)")
            continue
        default = node  # no dataclass behind the key (data.*, trainer.*): the type of verl's YAML default
        if default is None or (isinstance(default, str) and (default.startswith("${") or default == "???")):
            continue
        kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,), list: (list,), dict: (dict,)}
        wanted = kinds.get(type(default), (object,))
        if key.endswith("_files"):  # verl's data files: one path or a list of paths
            wanted = (str, list)
        if not isinstance(value, wanted) or (isinstance(value, bool) and type(default) is not bool):
            errors.append(f"{key}={value!r} does not have the type of verl's YAML default {default!r}")
    return errors
