"""The miniverl -> verl v0.8.0 field-rule table: one `Rule` per field of miniverl's resolved config,
so that the export, the import and the report's `field_rule_digest` read one and the same mapping.

A rule gives the verl key(s) a field is written to and how (`mapped`), how verl derives it from
other keys (`derived`), the one value verl hard-codes (`fixed_in_verl`), or why it has no verl
equivalent (`no_verl_equivalent`: a difference a user must know about; `not_applicable`: mechanics
of the miniature that mean nothing on a Ray cluster). The canonical JSON of these rules and of
`FIXED` (`rule_table`) is what `field_rule_digest` hashes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from miniverl import VERL_COMMIT, VERL_TAG
from miniverl.config.model import ToyArchitecture
from miniverl.verl_compat.defaults import ACTOR, ENTRY_POINT, FIXED, LOSS, MODEL, ROLLOUT, TEACHER, VERL_VERSION

STATUSES = ("mapped", "derived", "fixed_in_verl", "no_verl_equivalent", "not_applicable")


@dataclass(frozen=True)
class Rule:
    field: str
    status: str
    verl_keys: tuple[str, ...] = ()
    transform: str = ""
    note: str = ""
    verl_value: Any = None  # fixed_in_verl: the one value verl v0.8.0 runs with

    def as_dict(self) -> dict:
        out = {
            "field": self.field,
            "status": self.status,
            "verl_keys": list(self.verl_keys),
            "transform": self.transform,
            "note": self.note,
        }
        if self.status == "fixed_in_verl":
            out["verl_value"] = self.verl_value
        return out


def _m(fieldname: str, *keys: str, transform: str = "identity", note: str = "") -> Rule:
    return Rule(fieldname, "mapped", tuple(keys), transform, note)


def _na(fieldname: str, note: str) -> Rule:
    return Rule(fieldname, "not_applicable", note=note)


def _none(fieldname: str, note: str) -> Rule:
    return Rule(fieldname, "no_verl_equivalent", note=note)


TOY_FIELDS = tuple(f.name for f in fields(ToyArchitecture))
_TOY = "the toy architecture is built inside miniverl; verl loads Hugging Face models only"
_MAX_LEN = (f"{ROLLOUT}.max_model_len", f"{TEACHER}.inference.max_model_len")
_MAX_LEN_T = "max_model_len = recipe.prompt_limit + recipe.response_limit + 1 (student rollout and teacher)"

RULES: tuple[Rule, ...] = (
    # ---- model: the student
    _m(
        "model.model_id",
        f"{MODEL}.path",
        note="a hub id or a local folder (run_opd.sh: STUDENT_MODEL). model_id=toy has no verl equivalent: the "
        "export is then a template and run_opd.sh refuses to start until STUDENT_MODEL names a real model",
    ),
    _none(
        "model.revision",
        "verl has no revision key and loads actor_rollout_ref.model.path at the hub's current "
        "head: download the pinned revision (hf download ID --revision REV --local-dir DIR) and "
        "set STUDENT_MODEL=DIR",
    ),
    _m("model.tokenizer_id", f"{MODEL}.tokenizer_path", note="null: the model's own tokenizer"),
    _none("model.tokenizer_revision", "verl has no tokenizer revision key (see model.revision)"),
    _m(
        "model.trust_remote_code",
        f"{MODEL}.trust_remote_code",
        "data.trust_remote_code",
        note="verl reads it twice: for the model and for the dataset's tokenizer",
    ),
    _none(
        "model.dtype",
        "verl's FSDP actor keeps float32 weights (actor.fsdp_config.model_dtype=fp32) and computes "
        "in bfloat16 mixed precision; its rollout engine serves the student in bfloat16",
    ),
    _na(
        "model.attn_implementation",
        "verl loads the actor with flash_attention_2 and removes padding "
        "(model.use_remove_padding); the rollout engine picks its own kernels",
    ),
    _none(
        "model.quantization",
        "verl v0.8.0 has no 4-bit student: the FSDP actor trains the LoRA over the "
        "full-precision base and the rollout serves it in bfloat16, so memory per GPU is "
        "higher and log-probs differ slightly from NF4's",
    ),
    _na("model.prepare_kbit_training", "only meaningful for a 4-bit base (see model.quantization)"),
    _m("model.gradient_checkpointing", f"{MODEL}.enable_gradient_checkpointing"),
    Rule(
        "model.lora.enabled",
        "derived",
        (f"{MODEL}.lora_rank",),
        "enabled <=> lora_rank > 0",
        "verl trains a LoRA when lora_rank > 0 (written from model.lora.r); miniverl trains LoRA adapters only",
    ),
    _m("model.lora.r", f"{MODEL}.lora_rank", note="vLLM serves LoRA ranks up to 512"),
    _m("model.lora.alpha", f"{MODEL}.lora_alpha"),
    Rule(
        "model.lora.dropout",
        "fixed_in_verl",
        (),
        "",
        "verl's FSDP engine builds peft.LoraConfig without "
        "lora_dropout (peft's default, 0.0); another value does not carry over",
        0.0,
    ),
    _m(
        "model.lora.target_modules",
        f"{MODEL}.target_modules",
        transform="list of module names",
        note="verl's default is all-linear",
    ),
    Rule("model.lora.bias", "fixed_in_verl", (), "", "verl's FSDP engine always uses bias='none'", "none"),
    _m(
        "model.adapter",
        f"{MODEL}.lora_adapter_path",
        transform="absolute path",
        note="a PEFT adapter folder to start from (null: a fresh LoRA); verl loads it with PeftModel.from_pretrained, "
        "and lora_rank, lora_alpha and target_modules are then written from its adapter_config.json",
    ),
    *(_na(f"model.toy.{k}", _TOY) for k in TOY_FIELDS),
    # ---- teacher
    _m(
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
    _m(
        "teacher.model_id",
        f"{TEACHER}.model_path",
        note="run_opd.sh: TEACHER_MODEL; toy: see model.model_id; unused with teacher.mode=ref",
    ),
    _none(
        "teacher.revision",
        "verl has no revision key for the teacher: download the pinned revision and set TEACHER_MODEL to its folder",
    ),
    _none(
        "teacher.tokenizer_id",
        "verl feeds the student's token ids to the teacher (skip_tokenizer_init): the "
        "teacher must share the student's tokenizer",
    ),
    _none("teacher.tokenizer_revision", "see teacher.tokenizer_id"),
    _none(
        "teacher.trust_remote_code",
        "verl builds the teacher's model config without trust_remote_code: only "
        "architectures transformers knows natively",
    ),
    _m("teacher.dtype", f"{TEACHER}.inference.dtype", note="the inference engine's dtype (auto: its choice)"),
    _na("teacher.attn_implementation", "the teacher's inference engine picks its own kernels"),
    _none(
        "teacher.quantization",
        "verl v0.8.0 wires no 4-bit teacher: it runs on vLLM/SGLang in teacher.dtype in "
        "its own GPU pool, so teacher log-probs differ slightly from NF4's",
    ),
    _none(
        "teacher.adapter",
        "verl's teacher entry has no adapter key: merge the adapter into its base "
        "(PeftModel.merge_and_unload, save_pretrained) and export teacher.mode=standard with "
        "teacher.model_id=<merged folder>; the export refuses a teacher adapter",
    ),
    *(_na(f"teacher.toy.{k}", _TOY) for k in TOY_FIELDS),
    _na("teacher.toy_teacher_seed", _TOY),
    _na("teacher.toy_pretrain_steps", _TOY),
    _na("teacher.toy_pretrain_lr", _TOY),
    # ---- estimator: verl's distillation loss
    _m("estimator.loss_mode", f"{LOSS}.loss_mode"),
    _m("estimator.topk", f"{LOSS}.topk", note="written whatever its value: verl's YAML says 32, its dataclass 128"),
    _m(
        "estimator.use_policy_gradient",
        f"{LOSS}.use_policy_gradient",
        note="written whatever its value: verl's YAML says false, its dataclass true",
    ),
    _m("estimator.policy_loss_mode", f"{LOSS}.policy_loss_mode"),
    _m("estimator.clip_ratio", f"{LOSS}.clip_ratio"),
    _m("estimator.clip_ratio_low", f"{LOSS}.clip_ratio_low"),
    _m("estimator.clip_ratio_high", f"{LOSS}.clip_ratio_high"),
    Rule(
        "estimator.clip_ratio_c",
        "fixed_in_verl",
        (),
        "",
        "verl v0.8.0's distillation policy gradient reads "
        "clip_ratio_c from distillation_loss, which has no such field, so it always uses 3.0 "
        "(actor.clip_ratio_c is not read there); another value does not carry over",
        3.0,
    ),
    _m(
        "estimator.loss_max_clamp",
        f"{LOSS}.loss_max_clamp",
        note="written whatever its value: verl's YAML says null, its dataclass 10.0",
    ),
    _m(
        "estimator.log_prob_min_clamp",
        f"{LOSS}.log_prob_min_clamp",
        note="written whatever its value: verl's YAML says null, its dataclass -10.0",
    ),
    _m(
        "estimator.loss_agg_mode",
        f"{ACTOR}.loss_agg_mode",
        note="verl v0.8.0 normalises its first micro-batch with the previous update's token count; miniverl "
        "keeps the exact token mean (docs/losses.md)",
    ),
    # ---- hardware: one device
    _na("hardware.name", "the name of miniverl's hardware option"),
    _na("hardware.device", "verl runs on GPUs (trainer.device=cuda)"),
    _na("hardware.rollout_physical_batch", "verl's rollout engine batches continuously (rollout.max_num_seqs)"),
    _m(
        "hardware.update_chunk",
        f"{ACTOR}.ppo_micro_batch_size_per_gpu",
        f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu",
        note="rows per forward on each GPU, unless export.ppo_micro_batch_size_per_gpu / "
        "export.log_prob_micro_batch_size_per_gpu set them; verl needs it to divide each GPU's share",
    ),
    _na("hardware.logprob_chunk", "memory mechanics of miniverl's log-prob kernel"),
    _m(
        "hardware.deterministic",
        f"{ACTOR}.fsdp_config.full_determinism",
        note="the FSDP trainer only: verl's rollout engine samples without per-sample seeds, so a verl run is "
        "not byte-exact and its resume is not exact",
    ),
    _na("hardware.gpu_hour_limit", "the resource contract of miniverl's hardware option"),
    _na("hardware.peak_reserved_limit_gib", "the resource contract of miniverl's hardware option"),
    _na("hardware.simulate_oom_above_rows", "fault injection for miniverl's tests"),
    _na(
        "hardware.rollout_static_cache",
        "miniverl's own decode loop; verl's rollout engine (vLLM/SGLang) manages its KV cache",
    ),
    _na(
        "hardware.rollout_compile",
        "miniverl's own decode loop; verl's engine captures CUDA graphs itself (rollout.enforce_eager=false)",
    ),
    _na("hardware.rollout_cpu_gemv", "a CPU kernel choice of miniverl's decode loop; verl rolls out on GPUs"),
    _na(
        "hardware.rollout_dequantize_4bit_once",
        "a CPU choice of miniverl's decode loop over NF4 layers; verl's rollout has no 4-bit student",
    ),
    _na("hardware.cpu_float32_gemm", "a CPU kernel choice of miniverl's roles; verl trains on GPUs"),
    # ---- data
    _m(
        "data.train_files",
        "data.train_files",
        transform="list of absolute paths",
        note="relative paths are taken from the directory export runs in. verl's reward manager reads each row's "
        "data_source and reward_model.ground_truth even though task rewards are off",
    ),
    _na(
        "data.repeat_prompts",
        "verl goes through the data for trainer.total_epochs; the export sets "
        "trainer.total_training_steps to the plan's updates, repeating the data as needed",
    ),
    _m(
        "data.val_files",
        "data.val_files",
        transform="list of absolute paths; empty -> data.train_files",
        note="verl loads a validation set even with validation off, so an empty list writes the train files",
    ),
    _m("data.prompt_key", "data.prompt_key"),
    _m("data.filter_overlong_prompts", "data.filter_overlong_prompts"),
    _m("data.truncation", "data.truncation"),
    _m("data.shuffle", "data.shuffle"),
    _m("data.apply_chat_template_kwargs", "data.apply_chat_template_kwargs"),
    _m("data.seed", "data.seed"),
    # ---- eval: miniverl's held-out distillation-progress measurement
    _none(
        "eval.every",
        "verl's validation (trainer.test_freq, val_before_train) generates on data.val_files and "
        "scores the task reward, not the student-teacher KL miniverl measures; the export keeps it "
        "off",
    ),
    _na("eval.exact_kl_max_vocab", "miniverl's own held-out measurement"),
    _na("eval.response_limit", "miniverl's own held-out measurement"),
    # ---- trainer
    _m(
        "trainer.seed",
        f"{ACTOR}.fsdp_config.seed",
        note="seeds verl's trainer processes; verl's rollout does not seed each sample, so the sampled tokens "
        "differ from miniverl's",
    ),
    _m("trainer.project_name", "trainer.project_name"),
    _m("trainer.experiment_name", "trainer.experiment_name"),
    _m(
        "trainer.logger",
        "trainer.logger",
        transform="console -> console, jsonl -> file, tensorboard -> tensorboard",
        note="verl's file logger writes one JSON line per step",
    ),
    _na("trainer.progress_bar", "miniverl's console progress bar"),
    _m("trainer.save_freq", "trainer.save_freq", note="verl's checkpoints (FSDP shards + LoRA) are not miniverl's"),
    _m("trainer.max_actor_ckpt_to_keep", "trainer.max_actor_ckpt_to_keep"),
    _na("trainer.stop_after_updates", "miniverl's simulated preemption"),
    _na("trainer.overwrite", "whether miniverl may replace a previous run in its own run folder"),
    _m("trainer.resume_mode", "trainer.resume_mode"),
    _none(
        "trainer.resume_from",
        "a miniverl checkpoint cannot be resumed by verl (another format, and verl "
        "does not restore miniverl's sampler state); the export refuses it",
    ),
    # ---- actor and rollout nodes
    _m("actor.optim.lr", f"{ACTOR}.optim.lr", note="constant, no warm-up, as verl's defaults"),
    _m("actor.optim.betas", f"{ACTOR}.optim.betas"),
    _m(
        "actor.optim.eps",
        f"{ACTOR}.optim.override_optimizer_config",
        transform="x -> {eps: x}",
        note="verl's FSDP optimizer has no eps key; override_optimizer_config is passed to torch.optim.AdamW",
    ),
    _m("actor.optim.weight_decay", f"{ACTOR}.optim.weight_decay"),
    _m(
        "actor.grad_clip",
        f"{ACTOR}.optim.clip_grad",
        note="verl v0.8.0's engine clips with optim.clip_grad (actor.grad_clip is not read)",
    ),
    _m("actor.ppo_epochs", f"{ACTOR}.ppo_epochs"),
    _m(
        "rollout.temperature",
        f"{ROLLOUT}.temperature",
        note="the teacher is scored at temperature 1.0 whatever this is (FIXED): verl's teacher inherits the "
        "rollout temperature and refuses any other",
    ),
    _m("rollout.top_p", f"{ROLLOUT}.top_p"),
    _m("rollout.top_k", f"{ROLLOUT}.top_k"),
    _m(
        "algorithm.rollout_correction.bypass_mode",
        "algorithm.rollout_correction.bypass_mode",
        note="true: verl takes the old log-probs from its rollout engine (vLLM/SGLang), whose numerics differ from "
        "the trainer's more than miniverl's (one model for both); verl's PPO ratio then also corrects that gap",
    ),
    # ---- recipe
    _na("recipe.name", "a label (written into the launch's README and script header)"),
    _na("recipe.profile", "a label (written into the launch's README and script header)"),
    _m(
        "recipe.logical_batch",
        "data.train_batch_size",
        f"{ACTOR}.ppo_mini_batch_size",
        note="prompts per optimizer update, one sample each (rollout.n=1): one mini-batch per batch",
    ),
    _m(
        "recipe.optimizer_updates",
        "trainer.total_training_steps",
        "trainer.total_epochs",
        transform="total_training_steps = total_epochs = optimizer_updates",
        note="total_epochs is only an upper bound (each epoch has at least one step)",
    ),
    _na("recipe.interrupt_after_updates", "miniverl's own exact-resume check"),
    _m("recipe.prompt_limit", "data.max_prompt_length", *_MAX_LEN, transform=_MAX_LEN_T),
    _m("recipe.response_limit", "data.max_response_length", *_MAX_LEN, transform=_MAX_LEN_T),
    Rule(
        "recipe.teacher_target",
        "derived",
        (f"{LOSS}.loss_mode",),
        "from loss_mode",
        "verl asks the teacher for the sampled token's log-prob, or its top-k (prompt_logprobs=topk) for "
        "forward_kl_topk",
    ),
    # ---- export: the scale of the launch
    _m("export.nnodes", "trainer.nnodes"),
    _m("export.n_gpus_per_node", "trainer.n_gpus_per_node"),
    _m("export.teacher_nnodes", "distillation.nnodes"),
    _m("export.teacher_n_gpus_per_node", "distillation.n_gpus_per_node"),
    _m("export.teacher_replicas", f"{TEACHER}.num_replicas"),
    _m("export.teacher_tensor_parallel_size", f"{TEACHER}.inference.tensor_model_parallel_size"),
    _m("export.teacher_gpu_memory_utilization", f"{TEACHER}.inference.gpu_memory_utilization"),
    _m("export.rollout_name", f"{ROLLOUT}.name", f"{TEACHER}.inference.name"),
    _m("export.rollout_tensor_parallel_size", f"{ROLLOUT}.tensor_model_parallel_size"),
    _m("export.rollout_gpu_memory_utilization", f"{ROLLOUT}.gpu_memory_utilization"),
    _m(
        "export.ppo_micro_batch_size_per_gpu",
        f"{ACTOR}.ppo_micro_batch_size_per_gpu",
        transform="null -> hardware.update_chunk",
    ),
    _m(
        "export.log_prob_micro_batch_size_per_gpu",
        f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu",
        transform="null -> the actor's micro-batch",
    ),
    _m(
        "export.use_dynamic_bsz",
        f"{ACTOR}.use_dynamic_bsz",
        f"{ROLLOUT}.log_prob_use_dynamic_bsz",
        note="on: token-budget micro-batches, and no micro-batch sizes are written",
    ),
    _m(
        "export.max_token_len_per_gpu",
        f"{ACTOR}.ppo_max_token_len_per_gpu",
        f"{ROLLOUT}.log_prob_max_token_len_per_gpu",
        transform="null -> verl's default (16384)",
    ),
)


RULES_BY_FIELD = {rule.field: rule for rule in RULES}


def rule_for(path: str) -> Rule | None:
    """The rule of a config field; keys under a dict-valued field (data.apply_chat_template_kwargs.x)
    fall under that field's rule."""
    parts = path.split(".")
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
