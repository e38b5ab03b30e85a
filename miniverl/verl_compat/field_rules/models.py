"""Field rules of the models: `model` (the student), `teacher`, and several `teachers.<name>`
(each teacher field's rule, on that teacher's own verl entry)."""

from __future__ import annotations

import re
from dataclasses import replace

from miniverl.verl_compat.defaults import MODEL, TEACHER, TEACHERS
from miniverl.verl_compat.field_rules.rule import (
    TOY_FIELDS,
    TOY_NOTE,
    Rule,
    mapped,
    no_equivalent,
    not_applicable,
)

MODEL_RULES: tuple[Rule, ...] = (
    # ---- model: the student
    mapped(
        "model.model_id",
        f"{MODEL}.path",
        note="a hub id, or a local folder written as its absolute path (run_opd.sh: STUDENT_MODEL). model_id=toy "
        "has no verl equivalent: the export is then a template and run_opd.sh refuses to start until "
        "STUDENT_MODEL names a real model",
    ),
    no_equivalent(
        "model.revision",
        "verl has no revision key and loads actor_rollout_ref.model.path at the hub's current "
        "head: download the pinned revision (hf download ID --revision REV --local-dir DIR) and "
        "set STUDENT_MODEL=DIR",
    ),
    mapped(
        "model.tokenizer_id",
        f"{MODEL}.tokenizer_path",
        note="null: the model's own tokenizer; a local folder written as its absolute path",
    ),
    no_equivalent("model.tokenizer_revision", "verl has no tokenizer revision key (see model.revision)"),
    mapped(
        "model.trust_remote_code",
        f"{MODEL}.trust_remote_code",
        "data.trust_remote_code",
        note="verl reads it twice: for the model and for the dataset's tokenizer",
    ),
    no_equivalent(
        "model.dtype",
        "verl's FSDP actor keeps float32 weights (actor.fsdp_config.model_dtype=fp32) and computes "
        "in bfloat16 mixed precision; its rollout engine serves the student in bfloat16",
    ),
    not_applicable(
        "model.attn_implementation",
        "verl loads the actor with flash_attention_2 and removes padding "
        "(model.use_remove_padding); the rollout engine picks its own kernels",
    ),
    no_equivalent(
        "model.quantization",
        "verl has no 4-bit student: the FSDP actor trains the LoRA over the "
        "full-precision base and the rollout serves it in bfloat16, so memory per GPU is "
        "higher and log-probs differ slightly from NF4's",
    ),
    not_applicable("model.prepare_kbit_training", "only meaningful for a 4-bit base (see model.quantization)"),
    mapped("model.gradient_checkpointing", f"{MODEL}.enable_gradient_checkpointing"),
    mapped(
        "model.lora.r",
        f"{MODEL}.lora_rank",
        note="vLLM serves LoRA ranks up to 512; a rank > 0 is verl's LoRA switch (miniverl trains LoRA adapters only)",
    ),
    mapped("model.lora.alpha", f"{MODEL}.lora_alpha"),
    Rule(
        "model.lora.dropout",
        "fixed_in_verl",
        (),
        "",
        "verl's FSDP engine builds peft.LoraConfig without "
        "lora_dropout (peft's default, 0.0); another value does not carry over",
        0.0,
    ),
    mapped(
        "model.lora.target_modules",
        f"{MODEL}.target_modules",
        note="a list of layer names or all-linear, in both (verl's default is all-linear)",
    ),
    Rule("model.lora.bias", "fixed_in_verl", (), "", "verl's FSDP engine always uses bias='none'", "none"),
    mapped(
        "model.adapter",
        f"{MODEL}.lora_adapter_path",
        transform="absolute path",
        note="a PEFT adapter folder to start from (null: a fresh LoRA); verl loads it with PeftModel.from_pretrained, "
        "and lora_rank, lora_alpha and target_modules are then written from its adapter_config.json",
    ),
    *(not_applicable(f"model.toy.{k}", TOY_NOTE) for k in TOY_FIELDS),
    # ---- teacher
    not_applicable(
        "teacher.key",
        "the single teacher scores every row (verl keys its entry 'default'); the key routes several teachers",
    ),
    mapped(
        "teacher.mode",
        "distillation.enabled",
        f"{TEACHER}.model_path",
        transform="standard: distillation.enabled=True, teacher_model.model_path=teacher.model_id; ref: "
        "teacher_model.model_path=model.model_id; shared_base: refused",
        note="verl serves the frozen teacher on vLLM/SGLang in its own GPU pool (distillation.nnodes x "
        "distillation.n_gpus_per_node), never on the student's GPUs: ref becomes a second copy of the student's "
        "base there; shared_base (an adapter on the student's base) has no verl equivalent, since verl's teacher "
        "takes no adapter",
    ),
    mapped(
        "teacher.model_id",
        f"{TEACHER}.model_path",
        note="run_opd.sh: TEACHER_MODEL; a local folder written as its absolute path; toy: see model.model_id; unused "
        "with teacher.mode=ref",
    ),
    no_equivalent(
        "teacher.revision",
        "verl has no revision key for the teacher: download the pinned revision and set TEACHER_MODEL to its folder",
    ),
    no_equivalent(
        "teacher.tokenizer_id",
        "verl feeds the student's token ids to the teacher (skip_tokenizer_init): the "
        "teacher must share the student's tokenizer",
    ),
    no_equivalent("teacher.tokenizer_revision", "see teacher.tokenizer_id"),
    no_equivalent(
        "teacher.trust_remote_code",
        "verl builds the teacher's model config without trust_remote_code: only "
        "architectures transformers knows natively",
    ),
    mapped("teacher.dtype", f"{TEACHER}.inference.dtype", note="the inference engine's dtype (auto: its choice)"),
    not_applicable("teacher.attn_implementation", "the teacher's inference engine picks its own kernels"),
    no_equivalent(
        "teacher.quantization",
        "verl wires no 4-bit teacher: it runs on vLLM/SGLang in teacher.dtype in "
        "its own GPU pool, so teacher log-probs differ slightly from NF4's",
    ),
    no_equivalent(
        "teacher.adapter",
        "verl's teacher entry has no adapter key: merge the adapter into its base "
        "(PeftModel.merge_and_unload, save_pretrained) and export teacher.mode=standard with "
        "teacher.model_id=<merged folder>; the export refuses a teacher adapter",
    ),
    *(not_applicable(f"teacher.toy.{k}", TOY_NOTE) for k in TOY_FIELDS),
    not_applicable("teacher.toy_teacher_seed", TOY_NOTE),
    not_applicable("teacher.toy_pretrain_steps", TOY_NOTE),
    not_applicable("teacher.toy_pretrain_lr", TOY_NOTE),
    *(
        no_equivalent(
            f"teacher.context.{k}",
            "verl gives the teacher the student's prompt: a privileged context has no verl key; the "
            "export refuses it unless export.drop_teacher_context=true",
        )
        for k in ("system", "user", "prompt_limit")
    ),
    no_equivalent(
        "teacher.tokenizer_alignment",
        "verl's teacher scores the student's token ids, so it needs the student's tokenizer: the export "
        "refuses tokenizer_alignment=text",
    ),
    no_equivalent("teacher.alignment_credit", "read only with teacher.tokenizer_alignment=text, which verl has not"),
    no_equivalent(
        "teacher.unwritable_byte_log_prob", "read only with teacher.tokenizer_alignment=text, which verl has not"
    ),
)

# ---- several teachers: `teachers.<name>` (verl: distillation.teacher_models.<name>, a `+` entry each)
NAME = "<name>"
PER_TEACHER = "per teacher: on distillation.teacher_models.<name>"
SEVERAL_TEACHER_RULES: tuple[Rule, ...] = (
    mapped(
        "teachers",
        f"{TEACHERS}.{NAME}",
        transform="one +distillation.teacher_models.<name>.* entry per teacher (verl then drops teacher_model)",
        note="empty: the single `teacher`. Each teacher gets export.teacher_replicas replicas of "
        "export.teacher_tensor_parallel_size GPUs; the teacher pool must hold them all",
    ),
    mapped(f"teachers.{NAME}.key", f"{TEACHERS}.{NAME}.key", transform=PER_TEACHER),
    *(
        replace(
            rule,
            field=rule.field.replace("teacher.", f"teachers.{NAME}.", 1),
            verl_keys=tuple(k.replace(TEACHER, f"{TEACHERS}.{NAME}") for k in rule.verl_keys),
            transform=PER_TEACHER if rule.status == "mapped" else rule.transform,
            note=re.sub(r"\bteacher\.(?=[a-z])", f"teachers.{NAME}.", rule.note).replace(
                "TEACHER_MODEL", "TEACHER_<NAME>_MODEL"
            ),
        )
        for rule in MODEL_RULES
        if rule.field.startswith("teacher.") and rule.field != "teacher.key"
    ),
    mapped(
        "teacher_key",
        "distillation.teacher_key",
        note="the data column that routes rows to teachers (read with several teachers only)",
    ),
    no_equivalent(
        "default_teacher",
        "verl has no default teacher: a row whose key matches no teacher stops its run; the export "
        "refuses a default teacher",
    ),
)
