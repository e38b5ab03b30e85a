"""The file `python -m miniverl.import_verl` writes (import_verl.py reads the launch): one miniverl override
per mapped field, a free-form dict key by key, then as comments the verl overrides not imported (with why),
verl's engine settings apart, and the miniverl fields verl does not set."""

from __future__ import annotations

import re
from typing import Any

from miniverl.utils.overrides import hydra_value
from miniverl.verl_compat.field_rules import RULES
from miniverl.verl_compat.not_imported import ENGINE_WHY, REFUSED_WHY

FREE_FORM_DICTS = ("data.apply_chat_template_kwargs", "reward.custom_reward_function.reward_kwargs")


def override_lines(mapped: list[tuple[str, Any]]) -> list[str]:
    """miniverl override lines; a non-empty free-form dict field is written key by key (`++`, since
    Hydra refuses to merge new keys into a dict node of the config)."""
    lines = []
    for name, value in mapped:
        if isinstance(value, dict) and value and name in FREE_FORM_DICTS:
            lines += [f"++{name}.{k}={hydra_value(v)}" for k, v in value.items()]
        else:
            lines.append(f"{name}={hydra_value(value)}")
    return lines


def unset_fields(mapped: list[tuple[str, Any]]) -> list[str]:
    """miniverl fields a verl launch does not set (kept from the config the import is applied to)."""
    names = {name for name, _ in mapped}
    unread = "teacher." if any(name.startswith("teachers.") for name in names) else "teachers."
    out: list[str] = []
    for rule in RULES:
        if rule.field in names or rule.status not in ("no_verl_equivalent", "not_applicable"):
            continue
        if rule.field.startswith(unread):  # the single teacher's fields, or several teachers'
            continue
        name = re.sub(r"\.toy\..*$", ".toy.*", rule.field)
        if name not in out:
            out.append(name)
    return out


def render(
    source: str, mapped: list[tuple[str, Any]], unmapped: list[tuple[str, str]], version: str, note: str | None = None
) -> str:
    lines = [
        f"# miniverl overrides read from {source} (verl {version}: a key the launch leaves out takes its default)",
        "# use: python -m miniverl.main +recipe=opd_k1 $(grep -v '^#' THIS_FILE)",
    ]
    if note:  # read as another release than its header's (launch_reader.release_note)
        lines.append(f"# note: {note}")
    lines += override_lines(mapped)
    engine = [(line, why) for line, why in unmapped if why == ENGINE_WHY]
    refused = [line for line, why in unmapped if why == REFUSED_WHY]
    if refused:  # first: the launch does not run as written, whatever is imported from it
        lines.append(f"# verl {version} would refuse this launch at run time (the checks miniverl's export makes):")
        lines += [f"#   {line}" for line in refused]
    lines.append("# verl overrides with no miniverl field (not imported):")
    lines += [f"#   {line}  -- {why}" for line, why in unmapped if why not in (ENGINE_WHY, REFUSED_WHY)] or [
        "#   (none)"
    ]
    if engine:
        lines.append("# verl engine settings (how verl runs, not what it computes; miniverl runs one device):")
        lines += [f"#   {line}" for line, _ in engine]
    lines.append(
        "# miniverl fields verl does not set (kept from the config you apply this to): "
        + ", ".join(unset_fields(mapped))
    )
    return "\n".join(lines) + "\n"
