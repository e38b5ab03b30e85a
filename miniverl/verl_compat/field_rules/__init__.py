"""The miniverl -> verl v0.8.0 field-rule table: one `Rule` per field of miniverl's resolved config,
so that the export, the import and the report's `field_rule_digest` read one and the same mapping.

A rule gives the verl key(s) a field is written to and how (`mapped`), how verl derives it from
other keys (`derived`), the one value verl hard-codes (`fixed_in_verl`), or why it has no verl
equivalent (`no_verl_equivalent`: a difference a user must know about; `not_applicable`: mechanics
of the miniature that mean nothing on a Ray cluster). The canonical JSON of these rules and of
`FIXED` (`rule_table`) is what `field_rule_digest` hashes.
"""

from __future__ import annotations

from miniverl import VERL_COMMIT, VERL_TAG
from miniverl.verl_compat.defaults import ENTRY_POINT, FIXED, VERL_VERSION
from miniverl.verl_compat.field_rules.models import MODEL_RULES, NAME, SEVERAL_TEACHER_RULES
from miniverl.verl_compat.field_rules.rule import STATUSES, TOY_FIELDS, Rule
from miniverl.verl_compat.field_rules.run import RUN_RULES

__all__ = ["RULES", "RULES_BY_FIELD", "STATUSES", "TOY_FIELDS", "Rule", "rule_for", "rule_table"]

RULES: tuple[Rule, ...] = MODEL_RULES + SEVERAL_TEACHER_RULES + RUN_RULES
RULES_BY_FIELD = {rule.field: rule for rule in RULES}


def rule_for(path: str) -> Rule | None:
    """The rule of a config field; keys under a dict-valued field (data.apply_chat_template_kwargs.x)
    fall under that field's rule, and `teachers.<any name>.x` under `teachers.<name>.x`."""
    parts = path.split(".")
    if parts[0] == "teachers" and len(parts) > 2:
        parts[1] = NAME
    for end in range(len(parts), 0, -1):
        rule = RULES_BY_FIELD.get(".".join(parts[:end]))
        if rule is not None:
            return rule
    return None


def rule_table() -> dict:
    """The canonical rule table: what `field_rule_digest` hashes."""
    return {
        "verl": {"version": VERL_VERSION, "tag": VERL_TAG, "commit": VERL_COMMIT, "entry_point": ENTRY_POINT},
        "fields": [rule.as_dict() for rule in sorted(RULES, key=lambda r: r.field)],
        "fixed": [{"verl_key": key, "value": value, "why": why} for key, value, why in FIXED],
    }
