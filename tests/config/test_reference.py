"""The generated configuration reference (conf/_generated_config_reference.yaml) is current, shows
the composed default config's own values, and explains every key."""

from __future__ import annotations

from dataclasses import dataclass

import yaml
from omegaconf import OmegaConf

from miniverl.config import reference

from conftest import compose_config


def test_the_generated_reference_is_current_and_every_field_has_a_comment(capsys):
    status = reference.main(["--check"])
    assert status == 0, capsys.readouterr().err  # stale: python -m miniverl.config.reference rewrites it
    assert reference.render()[1] == []


def test_the_reference_holds_the_composed_default_configs_keys_and_values():
    shown = yaml.safe_load(reference.REFERENCE.read_text())
    composed = OmegaConf.to_container(compose_config(), resolve=True)
    assert shown == composed


@dataclass
class _Schema:
    explained: int = 1  # a trailing comment, as written
    # A comment above,
    # over two lines.
    above: str = "x"
    silent: bool = False


def test_a_field_without_a_comment_is_named_and_comments_are_read_from_either_place():
    missing: list[str] = []
    lines = reference.reference_lines(_Schema, {"explained": 1, "above": "x", "silent": False}, 2, "node.", missing)
    assert missing == ["node.silent"]
    assert lines == [
        "  # a trailing comment, as written",
        "  explained: 1",
        "  # A comment above, over two lines.",
        "  above: x",
        "  silent: false",
    ]


def test_help_says_what_the_command_does_before_composing_anything(capsys):
    assert reference.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("The configuration reference: every key of the composed default")
    assert (
        reference.main(["--write"]) == 2
        and "usage: python -m miniverl.config.reference [--check]" in capsys.readouterr().err
    )
