"""The package's layers: imports flow one way, from the commands down to config and protocol, and
no module outgrows the house's limits."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "miniverl"
# Lowest first; a module may import its own layer and those below it, never one above.
LAYERS = ("config", "utils", "models", "workers", "verl_compat", "trainer", "commands")
BOTTOM = {"miniverl", "miniverl.protocol", "miniverl.utils.errors"}  # constants, the Batch, the error type
MODULE_LINES = 400  # a module past this has two jobs
CONTROLLER_LINES = 300  # the controller drives the roles and computes nothing itself


def layer_of(module: str) -> int:
    if module in BOTTOM or module.startswith("miniverl.config"):
        return 0
    part = module.split(".")[1]
    return LAYERS.index(part) if part in LAYERS else LAYERS.index("commands")


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("miniverl") and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("miniverl")}
    return names


def test_imports_flow_from_the_commands_down_to_config_and_protocol():
    upward = [
        f"{source} imports {target}"
        for source, path in modules().items()
        for target in imported(path)
        if layer_of(target) > layer_of(source)
    ]
    assert upward == []


def test_no_layer_below_the_commands_imports_a_command():
    commands = {m for m in modules() if layer_of(m) == LAYERS.index("commands")}
    assert commands >= {"miniverl.main", "miniverl.doctor", "miniverl.bench", "miniverl.export"}
    users = [
        f"{source} imports {target}"
        for source, path in modules().items()
        if layer_of(source) < LAYERS.index("commands")
        for target in imported(path)
        if target in commands
    ]
    assert users == []


def test_no_module_outgrows_the_house_and_the_controller_stays_short():
    long = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MODULE_LINES}
    assert long == {}
    assert len((PACKAGE / "trainer" / "opd_trainer.py").read_text().splitlines()) <= CONTROLLER_LINES


def test_every_console_script_names_a_command_that_imports():
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert layer_of(module) == LAYERS.index("commands"), name
        assert callable(getattr(importlib.import_module(module), function)), name


def test_the_readme_layout_names_every_module():
    """README.md's Layout is the map of the code: each module is named there (a folder of like modules,
    reward_score/ and field_rules/, by the folder)."""
    import re

    readme = (PACKAGE.parent / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("```", 2)[1]
    words = set(re.findall(r"[\w]+", layout))
    missing = [
        str(path.relative_to(PACKAGE.parent))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.stem not in ("__init__", "__main__")
        and path.parent.name not in ("reward_score", "field_rules")
        and path.stem not in words
    ]
    assert missing == []
