"""Field rules of the training: estimator, hardware, data, eval, trainer, actor, rollout, algorithm,
reward, recipe, export."""

from __future__ import annotations

from miniverl.verl_compat.defaults import ACTOR, LOSS, ROLLOUT, TEACHER
from miniverl.verl_compat.field_rules.rule import (
    MAX_LEN_KEYS,
    MAX_LEN_TRANSFORM,
    Rule,
    mapped,
    no_equivalent,
    not_applicable,
)

RUN_RULES: tuple[Rule, ...] = (
    # ---- estimator: verl's distillation loss
    mapped("estimator.loss_mode", f"{LOSS}.loss_mode"),
    mapped("estimator.topk", f"{LOSS}.topk", note="written whatever its value: verl's YAML says 32, its dataclass 128"),
    mapped(
        "estimator.use_policy_gradient",
        f"{LOSS}.use_policy_gradient",
        note="written whatever its value: verl's YAML says false, its dataclass true",
    ),
    mapped("estimator.policy_loss_mode", f"{LOSS}.policy_loss_mode"),
    mapped("estimator.clip_ratio", f"{LOSS}.clip_ratio"),
    mapped("estimator.clip_ratio_low", f"{LOSS}.clip_ratio_low"),
    mapped("estimator.clip_ratio_high", f"{LOSS}.clip_ratio_high"),
    Rule(
        "estimator.clip_ratio_c",
        "fixed_in_verl",
        (),
        "",
        "verl's distillation policy gradient (0.8.0 and 0.9.1) reads "
        "clip_ratio_c from distillation_loss, which has no such field, so it always uses 3.0 "
        "(actor.clip_ratio_c is not read there); another value does not carry over",
        3.0,
    ),
    mapped(
        "estimator.loss_max_clamp",
        f"{LOSS}.loss_max_clamp",
        note="written whatever its value: verl's YAML says null, its dataclass 10.0",
    ),
    mapped(
        "estimator.log_prob_min_clamp",
        f"{LOSS}.log_prob_min_clamp",
        note="written whatever its value: verl's YAML says null, its dataclass -10.0",
    ),
    mapped(
        "estimator.use_task_rewards",
        f"{LOSS}.use_task_rewards",
        note="written whatever its value: verl's default is true, miniverl's false (pure distillation)",
    ),
    mapped("estimator.distillation_loss_coef", f"{LOSS}.distillation_loss_coef"),
    mapped(
        "estimator.loss_agg_mode",
        f"{ACTOR}.loss_agg_mode",
        note="token-sum is new in verl 0.9.0. verl 0.8.0 normalises the first micro-batch of each update with "
        "the previous update's counts (the ordering behind #7200, fixed in 0.9.0 by #7225); miniverl and verl 0.9 "
        "use the current mini-batch's for all (miniverl's docs/verl-versions.md)",
    ),
    mapped(
        "estimator.use_chunked_topk",
        f"{LOSS}.use_chunked_topk",
        note="written with + (in verl's dataclass, not in its YAML)",
        since="0.9.0",
        older_value=False,
    ),
    mapped(
        "estimator.chunked_topk_chunk_size",
        f"{LOSS}.chunked_topk_chunk_size",
        note="written with + (in verl's dataclass, not in its YAML); read only with use_chunked_topk",
        since="0.9.0",
    ),
    no_equivalent(
        "estimator.kl_discount_factor",
        "verl's distillation advantage is the per-token estimate (0.0); the export refuses another value",
    ),
    no_equivalent(
        "estimator.advantage_baseline",
        "verl's distillation advantage has no baseline (none); the export refuses another value",
    ),
    no_equivalent(
        "estimator.token_selection.by",
        "verl trains on every response token (none); the export refuses a selection",
    ),
    no_equivalent("estimator.token_selection.keep", "read only with a token selection (see token_selection.by)"),
    # ---- hardware: one device
    not_applicable("hardware.name", "the name of miniverl's hardware option"),
    not_applicable("hardware.device", "verl runs on GPUs (trainer.device=cuda)"),
    not_applicable(
        "hardware.rollout_physical_batch", "verl's rollout engine batches continuously (rollout.max_num_seqs)"
    ),
    mapped(
        "hardware.update_chunk",
        f"{ACTOR}.ppo_micro_batch_size_per_gpu",
        f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu",
        note="rows per forward on each GPU, unless export.ppo_micro_batch_size_per_gpu / "
        "export.log_prob_micro_batch_size_per_gpu set them; verl needs it to divide each GPU's share",
    ),
    not_applicable("hardware.logprob_chunk", "memory mechanics of miniverl's log-prob kernel"),
    mapped(
        "hardware.deterministic",
        f"{ACTOR}.fsdp_config.full_determinism",
        note="the FSDP trainer; from verl 0.9.1 the rollout too (rollout.full_determinism: vLLM's batch-invariant "
        "kernels and a seed per request). Before, verl's rollout samples without seeds, so a verl run is not "
        "byte-exact and its resume is not exact",
        later_keys=((f"{ROLLOUT}.full_determinism", "0.9.1"),),
    ),
    not_applicable("hardware.gpu_hour_limit", "the resource contract of miniverl's hardware option"),
    not_applicable("hardware.peak_reserved_limit_gib", "the resource contract of miniverl's hardware option"),
    not_applicable("hardware.simulate_oom_above_rows", "fault injection for miniverl's tests"),
    not_applicable(
        "hardware.rollout_static_cache",
        "miniverl's own decode loop; verl's rollout engine (vLLM/SGLang) manages its KV cache",
    ),
    not_applicable(
        "hardware.rollout_compile",
        "miniverl's own decode loop; verl's engine captures CUDA graphs itself (rollout.enforce_eager=false)",
    ),
    not_applicable(
        "hardware.rollout_cpu_gemv", "a CPU kernel choice of miniverl's decode loop; verl rolls out on GPUs"
    ),
    not_applicable(
        "hardware.rollout_dequantize_4bit_once",
        "a CPU choice of miniverl's decode loop over NF4 layers; verl's rollout has no 4-bit student",
    ),
    not_applicable(
        "hardware.rollout_cpu_prepack", "a CPU kernel choice of miniverl's decode loop; verl rolls out on GPUs"
    ),
    not_applicable(
        "hardware.rollout_cpu_fp16_lm_head", "a CPU kernel choice of miniverl's decode loop; verl rolls out on GPUs"
    ),
    not_applicable("hardware.cpu_float32_gemm", "a CPU kernel choice of miniverl's roles; verl trains on GPUs"),
    not_applicable("hardware.nf4_cache", "miniverl's loader reusing its NF4 quantization across starts"),
    # ---- data
    mapped(
        "data.train_files",
        "data.train_files",
        transform="list of absolute paths",
        note="relative paths are taken from the directory export runs in. verl's reward manager reads each row's "
        "data_source and reward_model.ground_truth, with task rewards off too",
    ),
    not_applicable(
        "data.repeat_prompts",
        "verl goes through the data for trainer.total_epochs; the export sets "
        "trainer.total_training_steps to the plan's updates, repeating the data as needed: the same batches "
        "pass by pass (each pass's last partial batch dropped on both sides)",
    ),
    mapped(
        "data.val_files",
        "data.val_files",
        transform="list of absolute paths; empty -> data.train_files",
        note="verl loads a validation set even with validation off, so an empty list writes the train files",
    ),
    mapped("data.prompt_key", "data.prompt_key"),
    mapped("data.filter_overlong_prompts", "data.filter_overlong_prompts"),
    mapped("data.shuffle", "data.shuffle"),
    mapped("data.apply_chat_template_kwargs", "data.apply_chat_template_kwargs"),
    mapped("data.seed", "data.seed"),
    # ---- eval: miniverl's held-out distillation-progress measurement
    no_equivalent(
        "eval.every",
        "verl's validation (trainer.test_freq, val_before_train) generates on data.val_files and "
        "scores the task reward, not the student-teacher KL miniverl measures; the export keeps it "
        "off",
    ),
    not_applicable("eval.exact_kl_max_vocab", "miniverl's own held-out measurement"),
    not_applicable("eval.response_limit", "miniverl's own held-out measurement"),
    # ---- trainer
    mapped(
        "trainer.seed",
        f"{ACTOR}.fsdp_config.seed",
        note="seeds verl's trainer processes, and from verl 0.9.1 its rollout (rollout.seed: vLLM's, plus the "
        "replica's rank); vLLM's sampler is not miniverl's, so the sampled tokens differ from miniverl's",
        later_keys=((f"{ROLLOUT}.seed", "0.9.1"),),
    ),
    mapped("trainer.project_name", "trainer.project_name"),
    mapped("trainer.experiment_name", "trainer.experiment_name"),
    mapped(
        "trainer.logger",
        "trainer.logger",
        transform="console -> console, jsonl -> file, tensorboard -> tensorboard, wandb -> wandb",
        note="verl's file logger writes one JSON line per step",
    ),
    not_applicable("trainer.progress_bar", "miniverl's console progress bar"),
    mapped(
        "trainer.save_freq",
        "trainer.save_freq",
        note="verl's checkpoints (FSDP shards + LoRA) are not miniverl's; verl's -1 saves none, miniverl's at a stop "
        "and at the end",
    ),
    mapped("trainer.max_actor_ckpt_to_keep", "trainer.max_actor_ckpt_to_keep"),
    not_applicable("trainer.stop_after_updates", "miniverl's simulated preemption"),
    not_applicable("trainer.overwrite", "whether miniverl may replace a previous run in its own run folder"),
    mapped("trainer.resume_mode", "trainer.resume_mode"),
    no_equivalent(
        "trainer.resume_from",
        "a miniverl checkpoint cannot be resumed by verl (another format, and verl "
        "does not restore miniverl's sampler state); the export refuses it",
    ),
    not_applicable(
        "trainer.resume_inexact",
        "whether miniverl resumes a checkpoint in a process that computes otherwise (verl checks no such thing)",
    ),
    # ---- actor and rollout nodes
    mapped("actor.optim.lr", f"{ACTOR}.optim.lr", note="constant, no warm-up, as verl's defaults"),
    mapped("actor.optim.betas", f"{ACTOR}.optim.betas"),
    mapped(
        "actor.optim.eps",
        f"{ACTOR}.optim.override_optimizer_config",
        transform="x -> {eps: x}",
        note="verl's FSDP optimizer has no eps key; override_optimizer_config is passed to torch.optim.AdamW",
    ),
    mapped("actor.optim.weight_decay", f"{ACTOR}.optim.weight_decay"),
    mapped(
        "actor.grad_clip",
        f"{ACTOR}.optim.clip_grad",
        note="verl's engine clips with optim.clip_grad (actor.grad_clip is not read)",
    ),
    mapped("actor.clip_ratio", f"{ACTOR}.clip_ratio", note="the task-reward PPO loss's (estimator.use_task_rewards)"),
    mapped("actor.clip_ratio_low", f"{ACTOR}.clip_ratio_low"),
    mapped("actor.clip_ratio_high", f"{ACTOR}.clip_ratio_high"),
    mapped("actor.clip_ratio_c", f"{ACTOR}.clip_ratio_c"),
    mapped(
        "rollout.temperature",
        f"{ROLLOUT}.temperature",
        note="the teacher is scored at temperature 1.0 whatever this is (FIXED): verl's teacher inherits the "
        "rollout temperature and refuses any other",
    ),
    mapped("rollout.top_p", f"{ROLLOUT}.top_p"),
    mapped("rollout.top_k", f"{ROLLOUT}.top_k"),
    mapped(
        "rollout.n",
        f"{ROLLOUT}.n",
        note="samples per prompt; miniverl gives each its own sampling stream, verl's engine does not seed them",
    ),
    mapped(
        "algorithm.adv_estimator",
        "algorithm.adv_estimator",
        note="written whatever its value: verl's default gae needs a critic, which neither builds here",
    ),
    mapped("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std_in_grpo"),
    mapped(
        "algorithm.rollout_correction.bypass_mode",
        "algorithm.rollout_correction.bypass_mode",
        note="true: verl takes the old log-probs from its rollout engine (vLLM/SGLang), whose numerics differ from "
        "the trainer's more than miniverl's (one model for both); verl's PPO ratio then also corrects that gap",
    ),
    # ---- reward: the task reward
    mapped(
        "reward.custom_reward_function.path",
        "reward.custom_reward_function.path",
        transform="absolute path; null -> the export's task_reward.py (task rewards on) or no_task_reward.py (off)",
        note="task_reward.py scores miniverl's data sources with verl's own scorers; no_task_reward.py scores 0",
    ),
    mapped(
        "reward.custom_reward_function.name",
        "reward.custom_reward_function.name",
        note="compute_score for the export's own files",
    ),
    mapped(
        "reward.custom_reward_function.reward_kwargs",
        "reward.custom_reward_function.reward_kwargs",
        note="passed to the user's own function only, as verl does; not in verl's YAML (written with +)",
    ),
    # ---- recipe
    not_applicable("recipe.name", "a label (written into the launch's README and script header)"),
    not_applicable("recipe.profile", "a label (written into the launch's README and script header)"),
    mapped(
        "recipe.logical_batch",
        "data.train_batch_size",
        f"{ACTOR}.ppo_mini_batch_size",
        note="prompts per optimizer update (rollout.n samples each): one mini-batch per batch",
    ),
    mapped(
        "recipe.optimizer_updates",
        "trainer.total_training_steps",
        "trainer.total_epochs",
        transform="total_training_steps = total_epochs = optimizer_updates",
        note="total_epochs is only an upper bound (each epoch has at least one step)",
    ),
    not_applicable("recipe.interrupt_after_updates", "miniverl's own exact-resume check"),
    not_applicable("recipe.resume_check_in_sweeps", "miniverl's own exact-resume check, in sweep jobs"),
    mapped("recipe.prompt_limit", "data.max_prompt_length", *MAX_LEN_KEYS, transform=MAX_LEN_TRANSFORM),
    mapped("recipe.response_limit", "data.max_response_length", *MAX_LEN_KEYS, transform=MAX_LEN_TRANSFORM),
    # ---- export: the release and the scale of the launch
    not_applicable(
        "export.verl_version",
        "the verl release the launch is written for (its rules, defaults and run-time checks; "
        "miniverl's docs/verl-versions.md); recorded in run_opd.sh, README.md and field_rules.json, and written by the "
        "import as the release it read the launch for",
    ),
    mapped("export.nnodes", "trainer.nnodes"),
    mapped("export.n_gpus_per_node", "trainer.n_gpus_per_node"),
    mapped("export.teacher_nnodes", "distillation.nnodes"),
    mapped("export.teacher_n_gpus_per_node", "distillation.n_gpus_per_node"),
    mapped("export.teacher_replicas", f"{TEACHER}.num_replicas"),
    mapped("export.teacher_tensor_parallel_size", f"{TEACHER}.inference.tensor_model_parallel_size"),
    mapped("export.teacher_gpu_memory_utilization", f"{TEACHER}.inference.gpu_memory_utilization"),
    mapped("export.rollout_name", f"{ROLLOUT}.name", f"{TEACHER}.inference.name"),
    mapped("export.rollout_tensor_parallel_size", f"{ROLLOUT}.tensor_model_parallel_size"),
    mapped("export.rollout_gpu_memory_utilization", f"{ROLLOUT}.gpu_memory_utilization"),
    mapped(
        "export.ppo_micro_batch_size_per_gpu",
        f"{ACTOR}.ppo_micro_batch_size_per_gpu",
        transform="null -> hardware.update_chunk",
    ),
    mapped(
        "export.log_prob_micro_batch_size_per_gpu",
        f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu",
        transform="null -> the actor's micro-batch",
    ),
    mapped(
        "export.use_dynamic_bsz",
        f"{ACTOR}.use_dynamic_bsz",
        f"{ROLLOUT}.log_prob_use_dynamic_bsz",
        note="on: token-budget micro-batches, and no micro-batch sizes are written",
    ),
    mapped(
        "export.max_token_len_per_gpu",
        f"{ACTOR}.ppo_max_token_len_per_gpu",
        f"{ROLLOUT}.log_prob_max_token_len_per_gpu",
        transform="null -> verl's default (16384)",
    ),
    not_applicable(
        "export.drop_teacher_context",
        "true: export a recipe whose teacher has a privileged context with the context dropped (verl's "
        "teacher sees the student's prompt); false: such an export is refused",
    ),
)
