"""The miniverl -> verl field-rule table: one `Rule` per field of miniverl's resolved config,
so that the export, the import and the report's `field_rule_digest` read one and the same mapping.

A rule gives the verl key(s) a field is written to and how (`mapped`), how verl derives it from
other keys (`derived`), the one value verl hard-codes (`fixed_in_verl`), or why it has no verl
equivalent (`no_verl_equivalent`: a difference a user must know about; `not_applicable`: mechanics
of the miniature that mean nothing on a Ray cluster). One table serves every release of
verl_compat.versions: a rule whose keys are newer than a release says so (`Rule.since`), and
`rules_for(version)` is the table as that release reads it. The canonical JSON of these rules, of
`FIXED` and of the release (`rule_table`) is what `field_rule_digest` hashes.
"""

from __future__ import annotations

from miniverl.verl_compat.defaults import ENTRY_POINT, FIXED
from miniverl.verl_compat.field_rules.models import MODEL_RULES, NAME, SEVERAL_TEACHER_RULES
from miniverl.verl_compat.field_rules.rule import STATUSES, TOY_FIELDS, Rule
from miniverl.verl_compat.field_rules.run import RUN_RULES
from miniverl.verl_compat.versions import PROFILE_VERSION, release

__all__ = [
    "EXPORTED_BY_CODE",
    "IMPORTED_BY_CODE",
    "RULES",
    "RULES_BY_FIELD",
    "STATUSES",
    "TOY_FIELDS",
    "Rule",
    "miniverl_names",
    "verl_key_hints",
    "rule_for",
    "rule_table",
    "rules_for",
    "table_read",
    "table_written",
]

RULES: tuple[Rule, ...] = MODEL_RULES + SEVERAL_TEACHER_RULES + RUN_RULES
RULES_BY_FIELD = {rule.field: rule for rule in RULES}

# The export writes every `mapped` rule of transform `identity` from this table, key by key
# (`table_written`), except these fields, written by code (launch_writer.verl_overrides), each for
# its reason; the keys of distillation.teacher_models.<name> are written per teacher entry
# (carry_over.teacher_entries), one entry per teacher. Rules of other transforms are code by nature.
EXPORTED_BY_CODE = {
    "model.lora.r": "a starting adapter's own adapter_config.json decides the rank, alpha and targets",
    "model.lora.alpha": "a starting adapter's own adapter_config.json decides the rank, alpha and targets",
    "model.lora.target_modules": "a starting adapter's own adapter_config.json decides the rank, alpha and targets",
    "hardware.update_chunk": "written only when export.ppo_micro_batch_size_per_gpu is null and batches are static",
    "data.apply_chat_template_kwargs": "one +data.apply_chat_template_kwargs.<name>=<value> per entry, as verl's "
    "examples write them",
    "teacher_key": "written only with several teachers: one teacher scores every row",
    "reward.custom_reward_function.reward_kwargs": "the user's own function's only ({} with the export's own "
    "scorer files, which take none)",
    "reward.custom_reward_function.name": "compute_score when the launch points at the export's own scorer file "
    "(task_reward.py, no_task_reward.py); the config's name only with the user's own file",
}
# The import reads every `mapped` rule of these transforms from this table (`table_read`), except
# the fields below, read by code (import_verl.to_miniverl), each for its reason.
IMPORT_TRANSFORMS = ("identity", "absolute path")
IMPORTED_BY_CODE = {
    "model.lora.r": "a rank of 0 is verl's full fine-tuning, which miniverl does not do: reported, not imported",
    "model.lora.target_modules": "verl also takes another string (a regex peft matches): reported, not imported",
    "hardware.update_chunk": "read only without dynamic batches; the rollout's micro-batch is another field",
    "export.teacher_replicas": "verl fills a single teacher's pool with as many replicas as fit",
    "algorithm.adv_estimator": "only verl's critic-free estimators (grpo, rloo) carry over",
}
TEACHER_ENTRY = "distillation.teacher_models."


def miniverl_names() -> dict[str, str]:
    """verl key -> the one miniverl field that holds it, where the two names differ (a verl user's spelling,
    for the one-line error of an unknown key; a verl key several fields map, max_model_len, is left out)."""
    fields: dict[str, set[str]] = {}
    for rule in RULES:
        for key in (*rule.verl_keys, *(later for later, _ in rule.later_keys)):
            if key != rule.field and not key.startswith(TEACHER_ENTRY + "<"):
                fields.setdefault(key, set()).add(rule.field)
    return {key: next(iter(names)) for key, names in fields.items() if len(names) == 1}


# A verl key whose miniverl field holds something else: what the user who typed it most likely wants.
KEY_HINTS = {
    "trainer.total_epochs": "trainer.total_epochs is verl's: miniverl counts optimizer updates, not passes over "
    "the data: recipe.optimizer_updates (the export sets total_epochs from it), and data.repeat_prompts=true to "
    "go through the prompts more than once",
}


def verl_key_hints() -> dict[str, str]:
    """verl key -> the fix for a user who typed it as a miniverl key (the one-line error of an unknown key):
    the miniverl field that holds it under another name, or why miniverl has none to set (a value verl's
    distillation needs, FIXED)."""
    hints = {key: f"{key} is verl's name: miniverl's is {field}" for key, field in miniverl_names().items()}
    hints.update({key: f"{key} is verl's: {why}" for key, _, why in FIXED if key not in hints})
    return {**hints, **KEY_HINTS}


def rules_for(version: str) -> tuple[Rule, ...]:
    """The table as verl `version` reads it (a rule newer than the release has no equivalent there)."""
    return tuple(rule.for_release(version) for rule in RULES)


def table_written(version: str) -> list[tuple[str, str]]:
    """(field, verl key) of every key the export for `version` writes from the table, in table order."""
    return [
        (rule.field, key)
        for rule in rules_for(version)
        if rule.status == "mapped" and rule.transform == "identity" and rule.field not in EXPORTED_BY_CODE
        for key in rule.verl_keys
        if not key.startswith(TEACHER_ENTRY)
    ]


def table_read(version: str) -> list[Rule]:
    """The rules the import of a verl `version` launch reads from the table, in table order."""
    return [
        rule
        for rule in rules_for(version)
        if rule.status == "mapped" and rule.transform in IMPORT_TRANSFORMS and rule.field not in IMPORTED_BY_CODE
    ]


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


def rule_table(version: str = PROFILE_VERSION) -> dict:
    """The canonical rule table for verl `version`: what `field_rule_digest` hashes (by default the
    profile's release, as the run report's identity)."""
    verl = release(version)
    return {
        "verl": {"version": verl.version, "tag": verl.tag, "source": verl.source, "entry_point": ENTRY_POINT},
        "fields": [rule.as_dict() for rule in sorted(rules_for(version), key=lambda r: r.field)],
        "fixed": [{"verl_key": key, "value": value, "why": why} for key, value, why in FIXED],
    }
