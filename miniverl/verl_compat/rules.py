"""The miniverl -> verl v0.8.0 field rules, verl's defaults, and the checks verl makes at run time.

Every field of miniverl's resolved config has one `Rule`: the verl key(s) it is written to and how
(`mapped`), how verl derives it from other keys (`derived`), the one value verl hard-codes
(`fixed_in_verl`), or why it has no verl equivalent (`no_verl_equivalent`: a difference a user must
know about; `not_applicable`: mechanics of the miniature that mean nothing on a Ray cluster).
`FIXED` lists the verl keys the export writes because of what the recipe *is* (pure on-policy
distillation), not because of a field. The canonical JSON of both is what `field_rule_digest`
hashes. `miniverl.export` writes verl overrides from these rules and `miniverl.import_verl` reads
them back; tests/test_export.py composes the result against verl's own config tree.

Nothing here imports verl: verl's YAML defaults that the export and the import rely on are copied
into `VERL_DEFAULTS` (verl/trainer/config/ppo_trainer.yaml and its defaults tree, unresolved), and a
test checks them against the installed verl 0.8.0.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from miniverl import VERL_COMMIT, VERL_TAG
from miniverl.config.model import ToyArchitecture

VERL_VERSION = "0.8.0"
ENTRY_POINT = "python3 -m verl.trainer.main_ppo"
TEACHER = "distillation.teacher_models.teacher_model"
LOSS = "distillation.distillation_loss"
ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"
MODEL = "actor_rollout_ref.model"

STATUSES = ("mapped", "derived", "fixed_in_verl", "no_verl_equivalent", "not_applicable")

# verl v0.8.0's YAML defaults (what `python3 -m verl.trainer.main_ppo` runs with when a key is not
# overridden), unresolved: interpolations are kept as verl writes them. Every key the export writes
# or the run-time checks read is here.
VERL_DEFAULTS: dict[str, Any] = {
    "algorithm.adv_estimator": "gae",
    "algorithm.use_kl_in_reward": False,
    "algorithm.rollout_correction.bypass_mode": False,
    "critic.enable": None,
    "data.train_files": "~/data/rlhf/gsm8k/train.parquet",
    "data.val_files": "~/data/rlhf/gsm8k/test.parquet",
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.prompt_key": "prompt",
    "data.filter_overlong_prompts": False,
    "data.truncation": "error",
    "data.shuffle": True,
    "data.seed": None,
    "data.apply_chat_template_kwargs": {},
    "data.trust_remote_code": False,
    f"{MODEL}.path": "~/models/deepseek-llm-7b-chat",
    f"{MODEL}.tokenizer_path": None,
    f"{MODEL}.trust_remote_code": False,
    f"{MODEL}.enable_gradient_checkpointing": True,
    f"{MODEL}.lora_rank": 0,
    f"{MODEL}.lora_alpha": 16,
    f"{MODEL}.target_modules": "all-linear",
    f"{MODEL}.lora_adapter_path": None,
    f"{ACTOR}.optim.lr": 1e-06,
    f"{ACTOR}.optim.betas": [0.9, 0.999],
    f"{ACTOR}.optim.weight_decay": 0.01,
    f"{ACTOR}.optim.clip_grad": 1.0,
    f"{ACTOR}.optim.override_optimizer_config": None,
    f"{ACTOR}.ppo_epochs": 1,
    f"{ACTOR}.ppo_mini_batch_size": 256,
    f"{ACTOR}.ppo_micro_batch_size": None,
    f"{ACTOR}.ppo_micro_batch_size_per_gpu": None,
    f"{ACTOR}.use_dynamic_bsz": False,
    f"{ACTOR}.ppo_max_token_len_per_gpu": 16384,
    f"{ACTOR}.loss_agg_mode": "token-mean",
    f"{ACTOR}.use_kl_loss": False,
    f"{ACTOR}.strategy": "fsdp",
    f"{ACTOR}.fsdp_config.full_determinism": False,
    f"{ACTOR}.fsdp_config.seed": 42,
    f"{ROLLOUT}.name": "???",
    f"{ROLLOUT}.n": 1,
    f"{ROLLOUT}.temperature": 1.0,
    f"{ROLLOUT}.top_p": 1,
    f"{ROLLOUT}.top_k": -1,
    f"{ROLLOUT}.dtype": "bfloat16",
    f"{ROLLOUT}.calculate_log_probs": False,
    f"{ROLLOUT}.tensor_model_parallel_size": 2,
    f"{ROLLOUT}.data_parallel_size": 1,
    f"{ROLLOUT}.pipeline_model_parallel_size": 1,
    f"{ROLLOUT}.gpu_memory_utilization": 0.5,
    f"{ROLLOUT}.max_model_len": None,
    f"{ROLLOUT}.prompt_length": "${oc.select:data.max_prompt_length,512}",
    f"{ROLLOUT}.response_length": "${oc.select:data.max_response_length,512}",
    f"{ROLLOUT}.log_prob_micro_batch_size": None,
    f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu": None,
    f"{ROLLOUT}.log_prob_use_dynamic_bsz": "${oc.select:actor_rollout_ref.actor.use_dynamic_bsz,false}",
    f"{ROLLOUT}.log_prob_max_token_len_per_gpu": "${oc.select:actor_rollout_ref.actor.ppo_max_token_len_per_gpu,16384}",
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8,
    "trainer.total_training_steps": None,
    "trainer.total_epochs": 30,
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
    "trainer.logger": ["console", "wandb"],
    "trainer.save_freq": -1,
    "trainer.max_actor_ckpt_to_keep": None,
    "trainer.resume_mode": "auto",
    "trainer.val_before_train": True,
    "trainer.test_freq": -1,
    "reward.custom_reward_function.path": None,
    "reward.custom_reward_function.name": "compute_score",
    "distillation.enabled": False,
    "distillation.nnodes": 0,
    "distillation.n_gpus_per_node": 8,
    f"{LOSS}.loss_mode": "k3",
    f"{LOSS}.topk": 32,
    f"{LOSS}.use_task_rewards": True,
    f"{LOSS}.use_policy_gradient": False,
    f"{LOSS}.policy_loss_mode": "vanilla",
    f"{LOSS}.clip_ratio": 0.2,
    f"{LOSS}.clip_ratio_low": 0.2,
    f"{LOSS}.clip_ratio_high": 0.2,
    f"{LOSS}.loss_max_clamp": None,
    f"{LOSS}.log_prob_min_clamp": None,
    f"{TEACHER}.model_path": None,
    f"{TEACHER}.num_replicas": 0,
    f"{TEACHER}.inference.name": "${oc.select:actor_rollout_ref.rollout.name}",
    f"{TEACHER}.inference.dtype": "${oc.select:actor_rollout_ref.rollout.dtype}",
    f"{TEACHER}.inference.tensor_model_parallel_size": 2,
    f"{TEACHER}.inference.data_parallel_size": 1,
    f"{TEACHER}.inference.gpu_memory_utilization": 0.5,
    f"{TEACHER}.inference.max_model_len": None,
    f"{TEACHER}.inference.prompt_length": "${oc.select:actor_rollout_ref.rollout.prompt_length}",
    f"{TEACHER}.inference.response_length": "${oc.select:actor_rollout_ref.rollout.response_length}",
    f"{TEACHER}.inference.temperature": "${oc.select:actor_rollout_ref.rollout.temperature}",
    f"{TEACHER}.inference.engine_kwargs": {},
}

# Where verl's dataclass defaults (verl/workers/config/distillation.py) differ from its YAML: the
# YAML is what main_ppo runs with, but the export writes these keys whatever their value, so the
# launch means the same thing under either.
DATACLASS_DEFAULTS_THAT_DIFFER: dict[str, Any] = {
    f"{LOSS}.topk": 128,
    f"{LOSS}.loss_max_clamp": 10.0,
    f"{LOSS}.log_prob_min_clamp": -10.0,
    f"{LOSS}.use_policy_gradient": True,
}

# verl v0.8.0's distillation losses (verl/trainer/distillation/losses.py registry).
VERL_LOSS_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "forward_kl_topk")
ROLLOUT_ENGINES = ("vllm", "sglang", "trtllm")
TEACHER_ENGINES = ("vllm", "sglang")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
VLLM_MAX_LORA_RANK = 512  # vllm MaxLoRARanks, as verl's get_vllm_max_lora_rank falls back to
LOGGERS_TO_VERL = {"console": "console", "jsonl": "file", "tensorboard": "tensorboard"}


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

# verl keys written because of what the recipe is, not from one field: (key, value, why).
FIXED: tuple[tuple[str, Any, str], ...] = (
    (
        f"{LOSS}.use_task_rewards",
        False,
        "pure on-policy distillation: no task reward (verl's YAML and dataclass both default to true)",
    ),
    ("algorithm.adv_estimator", "grpo", "no critic (verl's default gae needs one); task advantages are unused"),
    (f"{ROLLOUT}.n", 1, "one sample per prompt, as miniverl"),
    (
        f"{ROLLOUT}.calculate_log_probs",
        True,
        "miniverl records every sampled token's log-prob (rollout_log_probs): "
        "verl then logs training/rollout_probs_diff_* as miniverl does, and "
        "bypass_mode needs them",
    ),
    (
        f"{TEACHER}.inference.temperature",
        1.0,
        "verl scores the teacher at temperature 1.0 only (it inherits the rollout temperature otherwise)",
    ),
    (
        "trainer.val_before_train",
        False,
        "verl's validation scores task rewards, which pure distillation does not have (see eval.every)",
    ),
    (
        "reward.custom_reward_function.path",
        "<export>/no_task_reward.py",
        "a reward of 0 for every sample, so that verl's reward manager needs no scorer for the data_source",
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


# ---------------------------------------------------------------- Hydra override values

_SAFE = re.compile(r"^[A-Za-z0-9_./\-+@%~]+$")
_RESERVED = {"true", "false", "null", "inf", "nan", "-inf", "+inf"}


def hydra_value(value: Any) -> str:
    """A value in Hydra's override grammar that parses back to exactly `value`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        text = repr(value)
        return text if ("." in text or "e" in text or "n" in text) else text + ".0"
    if isinstance(value, str):
        if _SAFE.match(value) and value.lower() not in _RESERVED and not _looks_numeric(value):
            return value
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as a Hydra override value")


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def override_line(key: str, value: Any) -> str:
    return f"{key}={hydra_value(value)}"


# ---------------------------------------------------------------- verl's run-time checks


def get(cfg: Mapping, dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def runtime_violations(cfg: Mapping) -> list[str]:
    """The checks verl v0.8.0 makes only at run time (main_ppo's resource pools, validate_config,
    the engine workers, DistillationConfig.__post_init__, the teacher manager), on a composed and
    resolved verl config (a plain nested dict). Returns one line per violated rule; [] when valid."""
    out: list[str] = []
    g = lambda key, default=None: get(cfg, key, default)  # noqa: E731
    if not g("distillation.enabled"):
        out.append("distillation.enabled must be True: the launch is on-policy distillation")
        return out
    # Teacher pool: non-empty, and replicas x per-replica world size fill it exactly.
    t_nodes, t_per_node = g("distillation.nnodes", 0), g("distillation.n_gpus_per_node", 0)
    pool = t_nodes * t_per_node
    inference = f"{TEACHER}.inference"
    per_replica = (
        g(f"{inference}.tensor_model_parallel_size", 1)
        * g(f"{inference}.data_parallel_size", 1)
        * g(f"{inference}.pipeline_model_parallel_size", 1)
    )
    replicas = g(f"{TEACHER}.num_replicas", 0)
    if t_nodes <= 0 or t_per_node <= 0:
        out.append(
            f"the teacher pool is empty: distillation.nnodes={t_nodes}, distillation.n_gpus_per_node="
            f"{t_per_node} must both be > 0"
        )
    elif pool % per_replica or replicas * per_replica != pool:
        out.append(
            f"teacher pool size {pool} (distillation.nnodes x n_gpus_per_node) must equal num_replicas x "
            f"tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size = "
            f"{replicas} x {per_replica}"
        )
    elif (t_per_node % per_replica if per_replica <= t_per_node else per_replica % t_per_node) != 0:
        out.append(f"a teacher replica of {per_replica} GPUs straddles nodes of {t_per_node} GPUs")
    # Student: trainer pool, rollout replicas, batch sizes.
    n_gpus = g("trainer.nnodes", 0) * g("trainer.n_gpus_per_node", 0)
    if n_gpus <= 0:
        out.append("the trainer pool is empty: trainer.nnodes x trainer.n_gpus_per_node must be > 0")
        return out
    rollout_world = (
        g(f"{ROLLOUT}.tensor_model_parallel_size", 1)
        * g(f"{ROLLOUT}.data_parallel_size", 1)
        * g(f"{ROLLOUT}.pipeline_model_parallel_size", 1)
    )
    if n_gpus % rollout_world:
        out.append(
            f"the trainer's {n_gpus} GPUs are not divisible by the rollout replica's {rollout_world} "
            f"(actor_rollout_ref.rollout.tensor_model_parallel_size x data_parallel_size x "
            f"pipeline_model_parallel_size)"
        )
    name = g(f"{ROLLOUT}.name")
    if name in (None, "???") or name not in ROLLOUT_ENGINES:
        out.append(f"actor_rollout_ref.rollout.name={name!r} must name a rollout engine ({', '.join(ROLLOUT_ENGINES)})")
    teacher_name = g(f"{inference}.name")
    if teacher_name not in TEACHER_ENGINES:
        out.append(f"{inference}.name={teacher_name!r} must be one of {', '.join(TEACHER_ENGINES)}")
    dynamic = g(f"{ACTOR}.use_dynamic_bsz")
    if dynamic != g(f"{ROLLOUT}.log_prob_use_dynamic_bsz"):
        out.append("actor.use_dynamic_bsz and rollout.log_prob_use_dynamic_bsz must agree")
    n = g(f"{ROLLOUT}.n", 1)
    batch, mini = g("data.train_batch_size", 0) * n, g(f"{ACTOR}.ppo_mini_batch_size", 0)
    if g("data.train_batch_size", 0) < mini:
        out.append(f"data.train_batch_size={g('data.train_batch_size')} must be >= actor.ppo_mini_batch_size={mini}")
    if (mini * n) % n_gpus:
        out.append(f"actor.ppo_mini_batch_size x rollout.n = {mini * n} must be divisible by the {n_gpus} trainer GPUs")
    if not dynamic:
        if batch % n_gpus:
            out.append(f"data.train_batch_size x rollout.n = {batch} must be divisible by the {n_gpus} trainer GPUs")
        for key, per_gpu, legacy, rows in (
            (
                f"{ACTOR}.ppo_micro_batch_size_per_gpu",
                g(f"{ACTOR}.ppo_micro_batch_size_per_gpu"),
                g(f"{ACTOR}.ppo_micro_batch_size"),
                mini * n // n_gpus,
            ),
            (
                f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu",
                g(f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu"),
                g(f"{ROLLOUT}.log_prob_micro_batch_size"),
                batch // n_gpus,
            ),
        ):
            if per_gpu is None and legacy is None:
                out.append(f"{key} must be set when actor.use_dynamic_bsz is off")
            elif per_gpu is not None and legacy is not None:
                out.append(f"{key} and its deprecated twin without _per_gpu are both set")
            elif per_gpu is not None and (per_gpu < 1 or rows % per_gpu):
                out.append(f"{key}={per_gpu} must divide each GPU's {rows} rows")
    else:
        length = g("data.max_prompt_length", 0) + g("data.max_response_length", 0)
        for key in (f"{ACTOR}.ppo_max_token_len_per_gpu", f"{ROLLOUT}.log_prob_max_token_len_per_gpu"):
            if (g(key) or 0) < length:
                out.append(f"{key}={g(key)} must hold one prompt + response ({length} tokens)")
    # Context lengths: the teacher scores prompt + response and generates one token.
    for where, prompt_key, response_key in (
        (inference, f"{inference}.prompt_length", f"{inference}.response_length"),
        (ROLLOUT, f"{ROLLOUT}.prompt_length", f"{ROLLOUT}.response_length"),
    ):
        max_len = g(f"{where}.max_model_len")
        needed = g(prompt_key, 0) + g(response_key, 0) + 1
        if max_len is not None and max_len < needed:
            out.append(f"{where}.max_model_len={max_len} must be >= prompt + response + 1 = {needed}")
    # The distillation loss.
    loss = lambda key, default=None: g(f"{LOSS}.{key}", default)  # noqa: E731
    mode = loss("loss_mode")
    if mode not in VERL_LOSS_MODES:
        out.append(f"{LOSS}.loss_mode={mode!r} is not a verl v0.8.0 distillation loss")
    if mode == "k1" and not loss("use_policy_gradient"):
        out.append(f"{LOSS}.loss_mode=k1 needs use_policy_gradient=True (verl refuses to backpropagate k1)")
    if loss("policy_loss_mode") != "vanilla":
        out.append(f"{LOSS}.policy_loss_mode={loss('policy_loss_mode')!r}: verl v0.8.0 supports only vanilla")
    if mode == "forward_kl_topk":
        topk = loss("topk")
        if topk is None or topk < 1:
            out.append(f"{LOSS}.topk must be set for forward_kl_topk")
        elif teacher_name == "vllm":
            cap = (get(g(f"{inference}.engine_kwargs", {}) or {}, "vllm", {}) or {}).get("max_logprobs")
            if cap is not None and cap < topk:
                out.append(f"the teacher's vLLM max_logprobs={cap} must be >= topk={topk}")
    if loss("use_task_rewards"):
        out.append(f"{LOSS}.use_task_rewards must be False for pure distillation")
    if g(f"{inference}.temperature") != 1.0:
        out.append(
            f"{inference}.temperature={g(f'{inference}.temperature')} must be 1.0 (verl computes the "
            "teacher's prompt log-probs at temperature 1 only)"
        )
    if g("algorithm.rollout_correction.bypass_mode") and not g(f"{ROLLOUT}.calculate_log_probs"):
        out.append(
            f"algorithm.rollout_correction.bypass_mode=True needs {ROLLOUT}.calculate_log_probs=True (the "
            "rollout's log-probs are then the old log-probs)"
        )
    if g(f"{ACTOR}.loss_agg_mode") not in LOSS_AGG_MODES:
        out.append(f"{ACTOR}.loss_agg_mode={g(f'{ACTOR}.loss_agg_mode')!r} is not one of verl's")
    # LoRA: served by vLLM up to its largest rank.
    rank = g(f"{MODEL}.lora_rank", 0) or 0
    if name == "vllm" and rank > VLLM_MAX_LORA_RANK:
        out.append(f"{MODEL}.lora_rank={rank} exceeds vLLM's largest LoRA rank {VLLM_MAX_LORA_RANK}")
    # No critic: pure distillation has no value model.
    critic = g("critic.enable")
    if critic or (critic is None and g("algorithm.adv_estimator") == "gae"):
        out.append("a critic would be built (algorithm.adv_estimator=gae or critic.enable): distillation has none")
    if g(f"{ACTOR}.use_kl_loss") or g("algorithm.use_kl_in_reward"):
        out.append(
            "a KL to a reference policy is on (actor.use_kl_loss / algorithm.use_kl_in_reward): the recipe has none"
        )
    return out


def nested(flat: Mapping[str, Any]) -> dict:
    """{"a.b": 1} -> {"a": {"b": 1}}."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if isinstance(node.get(leaf), dict) and isinstance(value, Mapping):
            node[leaf].update(copy.deepcopy(dict(value)))
        else:
            node[leaf] = copy.deepcopy(value)
    return out


def virtual_verl_config(overrides: Mapping[str, Any]) -> dict:
    """verl's defaults for the keys in VERL_DEFAULTS with `overrides` applied, interpolated the way
    verl's YAML interpolates them: what the run-time checks read, without verl installed."""
    from omegaconf import OmegaConf

    merged = {**VERL_DEFAULTS, **overrides}
    return OmegaConf.to_container(OmegaConf.create(nested(merged)), resolve=True)
