"""What a miniverl config means that a verl launch (of `export.verl_version`) cannot carry: the settings it does not
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
from miniverl.config.model import hub_revision
from miniverl.utils.dataset import count_rows
from miniverl.verl_compat.defaults import TEACHER, TEACHERS
from miniverl.verl_compat.field_rules import RULES
from miniverl.verl_compat.launch_files import resolved_flat, teacher_variable
from miniverl.verl_compat.versions import EXPORT_DEFAULT, release

RULES_NOTE = {rule.field: rule.note for rule in RULES}


def adapter_lora(folder: str) -> tuple[int, int, list[str]] | None:
    """(r, alpha, target modules) of a PEFT adapter folder, or None when it cannot be read here."""
    try:
        config = json.loads((Path(folder) / "adapter_config.json").read_text())
        targets = config["target_modules"]
        # peft writes a set: sorted, so that the same adapter exports the same lines every time
        return int(config["r"]), int(config["lora_alpha"]), [targets] if isinstance(targets, str) else sorted(targets)
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
    values, version = resolved_flat(config), config.export.verl_version
    for rule in RULES:
        if rule.status == "fixed_in_verl" and values.get(rule.field) != rule.verl_value:
            out.append(
                f"{rule.field}={values.get(rule.field)!r} does not carry over: verl {version} runs with "
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
        if hub_revision(block.model_id, block.revision) is not None:  # a local folder loads no revision
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
    scale = micro_batch_scale(config)
    if scale is not None:
        out.append(scale)
    rows, batch = count_rows(config.data.train_files), config.recipe.logical_batch
    if rows is not None and rows < batch:  # miniverl repeats prompts (data.repeat_prompts); verl runs whole batches
        out.append(
            f"data.train_files hold {rows} rows, fewer than one batch (recipe.logical_batch={batch}, verl's "
            f"data.train_batch_size): verl {version} stops at start-up ("
            + ("'Train dataloader is empty!'" if version == "0.8.0" else "0 steps per epoch: a division by zero")
            + "); give the launch more rows (TRAIN_FILES=...) or lower recipe.logical_batch"
        )
    if config.estimator.use_task_rewards and not release(version).dapo_boxed_fallback:
        out.append(
            f"task rewards of math_dapo, math, math_dapo_reasoning and aime* rows: verl {version}'s rule reads the "
            "last `Answer:` line only, where miniverl's (verl 0.9's) falls back to the last \\boxed{} (a response "
            "with a right \\boxed{} and no such line scores -1 there)"
        )
    return out


def micro_batch_scale(config: MiniverlConfig) -> str | None:
    """On a release whose distillation loss reads the previous PPO loss call's normalisers (v0.8.0; the
    ordering behind verl #7200): what that does to this launch's loss scale, in one line; None when
    each GPU runs one micro-batch per update."""
    x = config.export
    if not release(x.verl_version).distillation_reads_previous_normalisers:
        return None
    rows = config.recipe.logical_batch * config.rollout.n // (x.nnodes * x.n_gpus_per_node)  # per GPU per update
    micro = x.ppo_micro_batch_size_per_gpu or config.hardware.update_chunk
    if not x.use_dynamic_bsz and rows <= micro:
        return None
    split = (
        f"splits each GPU's {rows} rows into micro-batches by token budget"
        if x.use_dynamic_bsz
        else f"splits each GPU's {rows} rows into {rows // micro} micro-batches of {micro}"
    )
    return (
        f"verl {x.verl_version} normalises the distillation loss of the first micro-batch of each update with the "
        f"previous update's token and row counts (its distillation_loss reads them before its PPO loss stores the "
        f"current ones; the ordering behind verl #7200, fixed in 0.9.0 by #7225): this launch {split}, so that "
        "micro-batch's share of the loss is scaled by (this update's tokens / the previous update's), and in the "
        "very first update by about the number of micro-batches (it is normalised by its own tokens); the others "
        f"match miniverl. For the same scale throughout: export.ppo_micro_batch_size_per_gpu={rows} (one "
        f"micro-batch), or export.verl_version={EXPORT_DEFAULT}"
    )


def refusal(config: MiniverlConfig) -> str | None:
    """Why verl (of `export.verl_version`) cannot run this config at all (one line), or None."""
    version = config.export.verl_version
    verl = release(version)
    est = config.estimator
    beyond = {  # miniverl's objectives beyond verl (docs/objectives.md), and what verl has instead
        "reverse_kl_full": "no full-vocabulary reverse KL loss (verl RFC #7239 asks for one)",
        "forward_kl_topk_tail": "no top-k forward KL with a tail bucket (verl RFC #7856, PR #7855, not merged)",
        "reverse_kl_topk": "no reverse KL over the student's top-k (verl #7425 / #7590, not merged)",
    }
    if est.loss_mode in beyond:
        return (
            f"estimator={est.loss_mode}: verl (v0.8.0, and v0.9 as well) has {beyond[est.loss_mode]}; export with "
            "estimator=k3 or estimator=forward_kl_topk"
        )
    if est.kl_discount_factor:
        return (
            f"estimator.kl_discount_factor={est.kl_discount_factor}: verl's distillation advantage is the per-token "
            "estimate; export with estimator.kl_discount_factor=0.0"
        )
    if est.advantage_baseline != "none":
        return (
            f"estimator.advantage_baseline={est.advantage_baseline}: verl's distillation advantage has no baseline; "
            "export with estimator.advantage_baseline=none"
        )
    if est.token_selection.by != "none":
        return (
            f"estimator.token_selection.by={est.token_selection.by}: verl trains on every response token; export "
            "with estimator.token_selection.by=none estimator.token_selection.keep=1.0"
        )
    if est.loss_agg_mode not in verl.loss_agg_modes:
        return (
            f"estimator.loss_agg_mode={est.loss_agg_mode}: verl {version} has only {', '.join(verl.loss_agg_modes)}; "
            f"export.verl_version={EXPORT_DEFAULT} has it"
        )
    values = resolved_flat(config)
    for rule in RULES:
        older = rule.for_release(version)
        if older is not rule and older.older_value is not None and values[rule.field] != older.older_value:
            return (
                f"{rule.field}={values[rule.field]!r}: verl {version} has no {', '.join(rule.verl_keys)} (new in "
                f"verl {rule.since}); export.verl_version={EXPORT_DEFAULT} has it, or set {rule.field}="
                f"{older.older_value}"
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
                f"{where}.mode={t.mode} with {where}.adapter: verl {version}'s teacher takes no "
                "adapter; merge it into its base (PeftModel.merge_and_unload, save_pretrained) and export "
                f"{where}.mode=standard {where}.model_id=<merged folder>"
            )
    aligned = [where for _, t, where in teacher_entries(config) if t.text_aligned]
    if aligned:
        return (
            f"{aligned[0]}.tokenizer_alignment=text: verl {version} has no distillation across tokenizers (its "
            "teacher scores the student's token ids); export a teacher of the student's tokenizer with "
            f"{aligned[0]}.tokenizer_alignment=none"
        )
    with_context = [where for _, t, where in teacher_entries(config) if t.context.enabled]
    if with_context and not config.export.drop_teacher_context:
        return (
            f"{with_context[0]}.context: verl {version} gives the teacher the student's prompt, so a privileged "
            "context cannot be exported; export.drop_teacher_context=true exports the recipe without it"
        )
    if "teacher_model" in config.teachers:
        return (
            f"teachers.teacher_model: verl {version} drops the entry of that name when there are several "
            "teachers; rename it (+teacher@teachers.<other name>=...)"
        )
    if config.default_teacher is not None:
        return (
            f"default_teacher={config.default_teacher}: verl {version} has no default teacher (a row whose "
            f"{config.teacher_key} matches no teacher's key stops its run); give those rows a teacher "
            "(teachers.<name>.key) and export with default_teacher=null"
        )
    return None
