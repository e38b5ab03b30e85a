"""The checks verl makes only at run time, replayed on a composed verl config: a launch verl would
refuse is then refused at export time, with one line, rather than on a Ray cluster. The rules are
v0.8.0's; where v0.9.1 differs, the release's facts (verl_compat.versions) say so.
"""

from __future__ import annotations

from collections.abc import Mapping

from miniverl.verl_compat.defaults import (
    ACTOR,
    LOSS,
    MODEL,
    ROLLOUT,
    ROLLOUT_ENGINES,
    TEACHER_ENGINES,
    TEACHERS,
    VERL_LOSS_MODES,
    VLLM_MAX_LORA_RANK,
)
from miniverl.verl_compat.overrides import get
from miniverl.verl_compat.versions import release


def served_teachers(cfg: Mapping) -> list[str]:
    """The teacher_models entries verl serves (DistillationConfig._resolve_teacher_models): the one
    it ships alone, or every other one when there are several (it drops `teacher_model` then)."""
    names = list(get(cfg, TEACHERS, {}) or {})
    if len(names) > 1:
        names = [n for n in names if n != "teacher_model"]
    return [f"{TEACHERS}.{name}" for name in names]


def runtime_violations(cfg: Mapping, version: str) -> list[str]:
    """The checks verl `version` makes only at run time (main_ppo's resource pools, validate_config,
    the engine workers, DistillationConfig.__post_init__, the teacher manager), on a composed and
    resolved verl config (a plain nested dict). Returns one line per violated rule; [] when valid."""
    verl = release(version)
    out: list[str] = []
    g = lambda key, default=None: get(cfg, key, default)  # noqa: E731
    if not g("distillation.enabled"):
        out.append("distillation.enabled must be True: the launch is on-policy distillation")
        return out
    # Teacher pool: non-empty, and the teachers' replicas x per-replica world sizes fill it exactly.
    t_nodes, t_per_node = g("distillation.nnodes", 0), g("distillation.n_gpus_per_node", 0)
    pool = t_nodes * t_per_node
    entries = served_teachers(cfg)
    world = lambda entry: (  # noqa: E731  (one replica's GPUs)
        g(f"{entry}.inference.tensor_model_parallel_size", 1)
        * g(f"{entry}.inference.data_parallel_size", 1)
        * g(f"{entry}.inference.pipeline_model_parallel_size", 1)
    )
    if t_nodes <= 0 or t_per_node <= 0:
        out.append(
            f"the teacher pool is empty: distillation.nnodes={t_nodes}, distillation.n_gpus_per_node="
            f"{t_per_node} must both be > 0"
        )
    elif len(entries) == 1:
        (entry,) = entries
        per_replica = world(entry)  # verl sets a single teacher's num_replicas itself: as many as the pool holds
        if pool % per_replica:
            out.append(
                f"a single teacher's replica of {per_replica} GPUs (tensor_model_parallel_size x data_parallel_size "
                f"x pipeline_model_parallel_size) must divide the teacher pool of {pool} (distillation.nnodes x "
                "n_gpus_per_node)"
            )
        elif (t_per_node % per_replica if per_replica <= t_per_node else per_replica % t_per_node) != 0:
            out.append(f"a teacher replica of {per_replica} GPUs straddles nodes of {t_per_node} GPUs")
    else:  # several: each entry fully configured, keys distinct, together filling the pool
        keys: dict[str, str] = {}
        for entry in entries:
            for field in ("model_path", "key", "num_replicas"):
                if g(f"{entry}.{field}") is None:
                    out.append(f"{entry}.{field} must be set (verl: check_configured)")
            key = g(f"{entry}.key")
            if key is not None and key in keys:
                out.append(f"{keys[key]} and {entry} have the same key {key!r} (verl: duplicate teacher key)")
            keys.setdefault(key, entry)
        total = sum((g(f"{entry}.num_replicas") or 0) * world(entry) for entry in entries)
        if total != pool:
            out.append(
                f"the teachers' num_replicas x per-replica world size add up to {total} GPUs; the teacher pool "
                f"(distillation.nnodes x n_gpus_per_node) has {pool}"
            )
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
    for entry in entries:
        teacher_engine = g(f"{entry}.inference.name")
        if teacher_engine not in TEACHER_ENGINES:
            out.append(f"{entry}.inference.name={teacher_engine!r} must be one of {', '.join(TEACHER_ENGINES)}")
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
    for where in [f"{entry}.inference" for entry in entries] + [ROLLOUT]:
        prompt_key, response_key = f"{where}.prompt_length", f"{where}.response_length"
        max_len = g(f"{where}.max_model_len")
        needed = g(prompt_key, 0) + g(response_key, 0) + 1
        if max_len is not None and max_len < needed:
            out.append(f"{where}.max_model_len={max_len} must be >= prompt + response + 1 = {needed}")
    # The distillation loss.
    loss = lambda key, default=None: g(f"{LOSS}.{key}", default)  # noqa: E731
    mode = loss("loss_mode")
    if mode not in VERL_LOSS_MODES:
        out.append(f"{LOSS}.loss_mode={mode!r} is not a verl {version} distillation loss")
    if mode == "k1" and not loss("use_policy_gradient"):
        out.append(f"{LOSS}.loss_mode=k1 needs use_policy_gradient=True (verl refuses to backpropagate k1)")
    if loss("policy_loss_mode") != "vanilla":
        out.append(f"{LOSS}.policy_loss_mode={loss('policy_loss_mode')!r}: verl {version} supports only vanilla")
    if mode == "forward_kl_topk":
        topk = loss("topk")
        if topk is None or topk < 1:
            out.append(f"{LOSS}.topk must be set for forward_kl_topk")
        for entry in entries:
            if g(f"{entry}.inference.name") == "vllm":
                kwargs = g(f"{entry}.inference.engine_kwargs", {}) or {}
                cap = (get(kwargs, "vllm", {}) or {}).get("max_logprobs")
                if cap is not None and cap < topk:
                    out.append(f"{entry}: the teacher's vLLM max_logprobs={cap} must be >= topk={topk}")
    for entry in entries:
        if g(f"{entry}.inference.temperature") != 1.0 and not verl.teacher_temperature_forced:
            out.append(
                f"{entry}.inference.temperature={g(f'{entry}.inference.temperature')} must be 1.0 (verl "
                f"{version} computes the teacher's prompt log-probs at temperature 1 only; 0.9 forces it to 1.0)"
            )
    if g("algorithm.rollout_correction.bypass_mode") and not g(f"{ROLLOUT}.calculate_log_probs"):
        out.append(
            f"algorithm.rollout_correction.bypass_mode=True needs {ROLLOUT}.calculate_log_probs=True (the "
            "rollout's log-probs are then the old log-probs)"
        )
    if g(f"{ACTOR}.loss_agg_mode") not in verl.loss_agg_modes:
        out.append(
            f"{ACTOR}.loss_agg_mode={g(f'{ACTOR}.loss_agg_mode')!r} is not one of verl {version}'s "
            f"({', '.join(verl.loss_agg_modes)})"
        )
    # LoRA: served by vLLM up to its largest rank.
    rank = g(f"{MODEL}.lora_rank", 0) or 0
    if name == "vllm" and rank > VLLM_MAX_LORA_RANK:
        out.append(f"{MODEL}.lora_rank={rank} exceeds vLLM's largest LoRA rank {VLLM_MAX_LORA_RANK}")
    # No critic: miniverl has no value model (its task advantages are GRPO or RLOO).
    critic = g("critic.enable")
    if critic or (critic is None and g("algorithm.adv_estimator") == "gae"):
        out.append("a critic would be built (algorithm.adv_estimator=gae or critic.enable): distillation has none")
    if g(f"{ACTOR}.use_kl_loss") or g("algorithm.use_kl_in_reward"):
        out.append(
            "a KL to a reference policy is on (actor.use_kl_loss / algorithm.use_kl_in_reward): the recipe has none"
        )
    return out
