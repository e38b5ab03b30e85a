"""verl's defaults and constants: what verl's own config and code say, copied here so that nothing
in miniverl imports verl (tests check `verl_defaults(version)` against each release's config tree).

`VERL_DEFAULTS` is v0.8.0's verl/trainer/config/ppo_trainer.yaml and its defaults tree, unresolved
(`verl_defaults` adds what a later release changed, from verl_compat.versions); `FIXED`
lists the verl keys the export writes because of what the recipe *is* (on-policy distillation on
miniverl's terms), not because of a field.
"""

from __future__ import annotations

from typing import Any

from miniverl.verl_compat.versions import LOSS, ROLLOUT, release

ENTRY_POINT = "python3 -m verl.trainer.main_ppo"
TEACHERS = "distillation.teacher_models"
TEACHER = f"{TEACHERS}.teacher_model"  # the entry verl ships: the single teacher's
ACTOR = "actor_rollout_ref.actor"
MODEL = "actor_rollout_ref.model"

# verl v0.8.0's YAML defaults (what `python3 -m verl.trainer.main_ppo` runs with when a key is not
# overridden), unresolved: interpolations are kept as verl writes them. Every key the export writes
# or the run-time checks read is here.
VERL_DEFAULTS: dict[str, Any] = {
    "algorithm.adv_estimator": "gae",
    "algorithm.norm_adv_by_std_in_grpo": True,
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
    f"{ACTOR}.loss_scale_factor": None,  # seq-mean-token-sum-norm's divisor; null: the padded response width
    f"{ACTOR}.clip_ratio": 0.2,
    f"{ACTOR}.clip_ratio_low": 0.2,
    f"{ACTOR}.clip_ratio_high": 0.2,
    f"{ACTOR}.clip_ratio_c": 3.0,
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
    "distillation.teacher_key": "data_source",
    f"{LOSS}.loss_mode": "k3",
    f"{LOSS}.topk": 32,
    f"{LOSS}.use_task_rewards": True,
    f"{LOSS}.distillation_loss_coef": 1.0,
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


def verl_defaults(version: str) -> dict[str, Any]:
    """The defaults of verl `version`: VERL_DEFAULTS with what that release changed in its YAML, and its
    keys it reads that its YAML does not have."""
    verl = release(version)
    return {**VERL_DEFAULTS, **verl.defaults_changed, **verl.defaults_outside_yaml}


# Where verl's dataclass defaults (verl/workers/config/distillation.py) differ from its YAML: the
# YAML is what main_ppo runs with, but the export writes these keys whatever their value, so the
# launch means the same thing under either.
DATACLASS_DEFAULTS_THAT_DIFFER: dict[str, Any] = {
    f"{LOSS}.topk": 128,
    f"{LOSS}.loss_max_clamp": 10.0,
    f"{LOSS}.log_prob_min_clamp": -10.0,
    f"{LOSS}.use_policy_gradient": True,
}

# verl's distillation losses (verl/trainer/distillation/losses.py registry; the same in v0.8.0 and v0.9.1).
VERL_LOSS_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "forward_kl_topk")
ROLLOUT_ENGINES = ("vllm", "sglang", "trtllm")
TEACHER_ENGINES = ("vllm", "sglang")
VLLM_MAX_LORA_RANK = 512  # vllm MaxLoRARanks, as verl's get_vllm_max_lora_rank falls back to
LOGGERS_TO_VERL = {"console": "console", "jsonl": "file", "tensorboard": "tensorboard", "wandb": "wandb"}

# verl keys written because of what the recipe is, not from one field: (key, value, why).
FIXED: tuple[tuple[str, Any, str], ...] = (
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
        f"{ACTOR}.ppo_epochs",
        1,
        "one epoch per batch: miniverl's update is on-policy (the PPO ratio is exactly 1), so it has no "
        "actor.ppo_epochs to set",
    ),
    (
        "data.truncation",
        "error",
        "an overlong prompt is an error, or with data.filter_overlong_prompts dropped (verl 0.8.0's RL dataset "
        "reads data.truncation but does not apply it), so miniverl has no data.truncation to set",
    ),
    (
        "trainer.val_before_train",
        False,
        "verl's validation scores the task reward on data.val_files; miniverl's held-out measurement is the "
        "student-teacher KL (eval.every), which verl does not have",
    ),
)
