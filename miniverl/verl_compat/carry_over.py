"""What a miniverl config means that a verl v0.8.0 launch cannot carry: the settings it does not
reproduce (`differences`: warnings, written into the export's README) and the ones it cannot run
at all (`refusal`: the export stops with one line). And each teacher's verl entry
(`teacher_entries`), which both read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miniverl.config import MiniverlConfig
from miniverl.config.export import teacher_pool_problem
from miniverl.verl_compat.defaults import TEACHER, TEACHERS
from miniverl.verl_compat.field_rules import RULES
from miniverl.verl_compat.launch_files import resolved_flat, teacher_variable

RULES_NOTE = {rule.field: rule.note for rule in RULES}


def adapter_lora(folder: str) -> tuple[int, int, list[str]] | None:
    """(r, alpha, target modules) of a PEFT adapter folder, or None when it cannot be read here."""
    try:
        config = json.loads((Path(folder) / "adapter_config.json").read_text())
        targets = config["target_modules"]
        return int(config["r"]), int(config["lora_alpha"]), [targets] if isinstance(targets, str) else list(targets)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def teacher_entries(config: MiniverlConfig) -> list[tuple[str, Any, str]]:
    """(verl teacher_models entry, teacher block, miniverl config path) of every teacher: the entry
    verl ships (`teacher_model`) for the single teacher, one named entry per teacher for several
    (verl then drops `teacher_model`)."""
    if not config.teachers:
        return [(TEACHER, config.teacher, "teacher")]
    return [(f"{TEACHERS}.{name}", block, f"teachers.{name}") for name, block in config.teachers.items()]


# ---------------------------------------------------------------- what does not carry over


def differences(config: MiniverlConfig) -> list[str]:
    """The settings of this config that the verl launch does not reproduce, one line each."""
    out: list[str] = []
    values = resolved_flat(config)
    for rule in RULES:
        if rule.status == "fixed_in_verl" and values.get(rule.field) != rule.verl_value:
            out.append(
                f"{rule.field}={values.get(rule.field)!r} does not carry over: verl v0.8.0 runs with "
                f"{rule.verl_value!r} ({rule.note.split(';')[0]})"
            )
    models = [("model", config.model, "model")] + [(where, t, "teacher") for _, t, where in teacher_entries(config)]
    for where, block, kind in models:
        if block.model_id == "toy":
            out.append(
                f"{where}.model_id=toy has no verl equivalent: the launch is a template until "
                f"{'STUDENT_MODEL' if where == 'model' else teacher_variable(where)} names a Hugging Face model "
                "(run_opd.sh refuses to start before)"
            )
        if block.quantization == "nf4":
            out.append(f"{where}.quantization=nf4 does not carry over: {RULES_NOTE[kind + '.quantization']}")
        if block.revision is not None:
            note = RULES_NOTE[kind + ".revision"]
            if kind == "teacher":  # the launch's variable of this teacher
                note = note.replace("TEACHER_MODEL", teacher_variable(where))
            out.append(f"{where}.revision={block.revision} is not pinned by verl: {note}")
        if kind == "teacher" and block.mode == "ref":
            out.append(
                f"{where}.mode=ref: verl serves a second copy of the student's base (model.model_id) as the "
                "teacher, in the teacher pool"
            )
    if config.model.adapter is not None and adapter_lora(config.model.adapter) is None:
        out.append(
            f"model.adapter={config.model.adapter}: its adapter_config.json cannot be read here, so lora_rank, "
            "lora_alpha and target_modules come from model.lora; they must match the adapter"
        )
    for _, t, where in teacher_entries(config):
        if t.context.enabled:  # refused unless export.drop_teacher_context=true
            out.append(
                f"{where}.context is dropped (export.drop_teacher_context=true): verl's teacher scores the "
                "student's prompt, not its own"
            )
        if t.trust_remote_code:
            out.append(f"{where}.trust_remote_code=true does not carry over: {RULES_NOTE['teacher.trust_remote_code']}")
        if t.tokenizer_id is not None:
            out.append(f"{where}.tokenizer_id does not carry over: {RULES_NOTE['teacher.tokenizer_id']}")
    return out


def refusal(config: MiniverlConfig) -> str | None:
    """Why verl v0.8.0 cannot run this config at all (one line), or None."""
    if config.estimator.uses_full_vocab:
        return (
            "estimator=reverse_kl_full: verl (v0.8.0, and v0.9 as well) has no full-vocabulary reverse KL "
            "loss (verl RFC #7239 asks for one); export with estimator=k3 or estimator=forward_kl_topk"
        )
    problem = teacher_pool_problem(config.export, len(config.teacher_blocks))
    if problem:
        return problem
    if config.trainer.resume_from is not None:
        return (
            "trainer.resume_from: a miniverl checkpoint cannot be resumed by verl; export without it "
            "(the verl run starts fresh)"
        )
    for _, t, where in teacher_entries(config):
        if t.adapter is not None:
            return (
                f"{where}.mode={t.mode} with {where}.adapter: verl v0.8.0's teacher takes no "
                "adapter; merge it into its base (PeftModel.merge_and_unload, save_pretrained) and export "
                f"{where}.mode=standard {where}.model_id=<merged folder>"
            )
    with_context = [where for _, t, where in teacher_entries(config) if t.context.enabled]
    if with_context and not config.export.drop_teacher_context:
        return (
            f"{with_context[0]}.context: verl v0.8.0 gives the teacher the student's prompt, so a privileged "
            "context cannot be exported; export.drop_teacher_context=true exports the recipe without it"
        )
    if "teacher_model" in config.teachers:
        return (
            "teachers.teacher_model: verl v0.8.0 drops the entry of that name when there are several "
            "teachers; rename it (+teacher@teachers.<other name>=...)"
        )
    if config.default_teacher is not None:
        return (
            f"default_teacher={config.default_teacher}: verl v0.8.0 has no default teacher (a row whose "
            f"{config.teacher_key} matches no teacher's key stops its run); give those rows a teacher "
            "(teachers.<name>.key) and export with default_teacher=null"
        )
    return None
