"""`report.json`'s `models` block: each model's config block as resolved, under the reference report's
names, with what loading it measured or pinned (its adapter's sha256, the revision it was loaded at, the
bytes a teacher's weights hold)."""

from __future__ import annotations

import dataclasses

from miniverl.config import MiniverlConfig
from miniverl.config.model import hub_revision
from miniverl.models.adapters import adapter_sha256, lora_settings
from miniverl.utils.identity import sha256_json

# What a teacher of mode ref or shared_base takes from the student: the model it runs on and how it is loaded.
BASE_FIELDS = (
    "model_id",
    "revision",
    "tokenizer_id",
    "tokenizer_revision",
    "quantization",
    "dtype",
    "attn_implementation",
    "trust_remote_code",
    "toy",
)


def config_fields(block) -> dict:
    """A model block's config fields; its `toy` settings only where it is a toy (they build nothing else)."""
    fields = dataclasses.asdict(block)
    if block.model_id != "toy":
        fields.pop("toy")
    return fields


def loaded_revisions(block) -> dict:
    """The revisions a model block was loaded at: null for a local folder (a preset's pin names
    another repository's commit there), as the config gives them for a hub id."""
    return {
        "revision": hub_revision(block.model_id, block.revision),
        "tokenizer_revision": hub_revision(block.tokenizer_id, block.tokenizer_revision),
    }


def student_block(cfg: MiniverlConfig) -> dict:
    """`models.student`: the student's config under the reference report's names; `lora.enabled` is
    always true (miniverl trains LoRA adapters only, so it is no config key); started from an adapter,
    `lora` is what that adapter's adapter_config.json set (model.lora is not read then)."""
    block = {**config_fields(cfg.model), **loaded_revisions(cfg.model)}
    block["lora"] = {"enabled": True, **(lora_settings(cfg.model.adapter) if cfg.model.adapter else block["lora"])}
    return {**block, "adapter_sha256": adapter_sha256(cfg.model.adapter)}


def teachers_block(cfg: MiniverlConfig, weight_bytes: dict[str, int]) -> dict:
    """The report's teacher entries: `teacher` (the reference report's fields), or with several
    `teachers` by name (each with its key), `teacher_key` and `default_teacher`; each with the
    bytes its weights add (`weight_bytes`, measured on the loaded model)."""

    student = {**config_fields(cfg.model), **loaded_revisions(cfg.model)}

    def entry(name: str, block, with_key: bool) -> dict:
        fields = {**config_fields(block), **loaded_revisions(block)}
        if block.mode != "standard":  # the student's base scores: its model, not the block's unread one
            for key in BASE_FIELDS:
                fields.pop(key, None)
                if key in student:
                    fields[key] = student[key]
        if not with_key:
            fields.pop("key")  # the single teacher reads no key
        context = sha256_json(fields["context"]) if block.context.enabled else None  # the templates' identity
        return {
            **fields,
            "adapter_sha256": adapter_sha256(block.adapter),
            "context_sha256": context,
            "weight_bytes": weight_bytes.get(name),
        }

    if not cfg.teachers:
        return {"teacher": entry("teacher", cfg.teacher, with_key=False)}
    return {
        "teachers": {name: entry(name, block, with_key=True) for name, block in cfg.teachers.items()},
        "teacher_key": cfg.teacher_key,
        "default_teacher": cfg.default_teacher,
    }
