"""Export a recipe as a real verl v0.8.0 launch: `python -m miniverl.export +recipe=opd_k1 [overrides]`.

A Hydra app like `miniverl.main`: the same config, the same overrides. It writes, in its run folder,

    verl/overrides.txt     one Hydra override per line, for `python3 -m verl.trainer.main_ppo`
    verl/run_opd.sh        the launch, in the shape of verl's
                           examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh
    verl/field_rules.json  every miniverl field's rule (miniverl.verl_compat.field_rules) and what it wrote here
    verl/no_task_reward.py the zero task reward the launch points verl's reward manager at (task rewards off),
    verl/task_reward.py    or, with estimator.use_task_rewards=true, miniverl's rules through verl's own
                           scorers (none when reward.custom_reward_function names the user's own)
    verl/README.md         how to run it, and what does not carry over from miniverl

The scale is set by the `export.*` knobs (conf/export/default.yaml; defaults: one trainer GPU plus
one teacher GPU). Before writing anything the export runs the checks verl makes only at run time
(`runtime_checks.runtime_violations`) on the launch, so a launch verl would refuse is refused here with
one line; what cannot carry over at all, or only with a difference, is `carry_over`'s. For the
report: `field_rule_digest()` is the sha256 of the canonical rule table.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from miniverl.config import MiniverlConfig, to_config
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import resolved_config, sha256_json
from miniverl.utils.tables import flatten
from miniverl.verl_compat.carry_over import adapter_lora, differences, refusal, teacher_entries
from miniverl.verl_compat.defaults import (
    ACTOR,
    FIXED,
    LOGGERS_TO_VERL,
    LOSS,
    MODEL,
    ROLLOUT,
    TEACHER,
    VERL_DEFAULTS,
)
from miniverl.verl_compat.field_rules import rule_for, rule_table
from miniverl.verl_compat.launch_files import (
    LaunchReward,
    Override,
    absolute_path,
    launch_reward,
    launch_script,
    readme,
    rules_document,
)
from miniverl.verl_compat.overrides import virtual_verl_config
from miniverl.verl_compat.runtime_checks import runtime_violations

EXPORT_FOLDER = "verl"

__all__ = ["field_rules", "field_rule_digest", "rule_table", "verl_overrides", "export"]


# ---------------------------------------------------------------- rules and their digest


def config_fields(cfg: DictConfig | MiniverlConfig | dict) -> list[str]:
    """The dotted path of every leaf of the resolved config (Hydra's runtime node excluded)."""
    if isinstance(cfg, DictConfig):
        plain = resolved_config(cfg)
    elif is_dataclass(cfg):
        plain = asdict(cfg)
    else:
        plain = cfg
    return list(flatten(plain))


def field_rules(cfg: DictConfig | MiniverlConfig | dict | None = None) -> list[dict]:
    """The canonical rule of every miniverl field (sorted by field). With `cfg`, also checks that
    each field of that resolved config has a rule, and refuses with the ones that have none."""
    if cfg is not None:
        missing = [path for path in config_fields(cfg) if rule_for(path) is None]
        if missing:
            raise MiniverlError(
                f"no verl field rule for {', '.join(missing)} (add one to miniverl/verl_compat/field_rules/)"
            )
    return rule_table()["fields"]


def field_rule_digest(table: Any = None) -> str:
    """sha256 of the canonical JSON of the rule table (field rules + the keys the recipe fixes, with
    the verl version they target): the report's `profile_identity.field_rule_digest`. The table does
    not depend on a config, so `field_rule_digest()` and `field_rule_digest(cfg)` agree; pass a rule
    table (a dict with "fields") to hash that one instead."""
    return sha256_json(table if isinstance(table, dict) and "fields" in table else rule_table())


# ---------------------------------------------------------------- the overrides


def verl_overrides(config: MiniverlConfig, *, reward: LaunchReward, cwd: Path) -> list[Override]:
    """The verl v0.8.0 overrides that run `config` (every key the rules map, plus FIXED)."""
    m, t, e, d, tr = config.model, config.teacher, config.estimator, config.data, config.trainer
    r, x, hw, algo, clip = config.recipe, config.export, config.hardware, config.algorithm, config.actor
    fixed = {key: value for key, value, _ in FIXED}
    max_len = r.prompt_limit + r.response_limit + 1
    files = [absolute_path(p, cwd) for p in d.train_files]
    val_files = [absolute_path(p, cwd) for p in getattr(d, "val_files", None) or []]
    ppo_micro = x.ppo_micro_batch_size_per_gpu if x.ppo_micro_batch_size_per_gpu is not None else hw.update_chunk
    log_prob_micro = ppo_micro if x.log_prob_micro_batch_size_per_gpu is None else x.log_prob_micro_batch_size_per_gpu
    micro_src = (
        ("export.ppo_micro_batch_size_per_gpu",)
        if x.ppo_micro_batch_size_per_gpu is not None
        else ("hardware.update_chunk",)
    )
    log_prob_src = (
        ("export.log_prob_micro_batch_size_per_gpu",) if x.log_prob_micro_batch_size_per_gpu is not None else micro_src
    )
    lengths = ("recipe.prompt_limit", "recipe.response_limit")
    out: list[Override] = []

    def add(section: str, key: str, value: Any, *sources: str) -> None:
        out.append(Override(section, key, value, sources or ("fixed",)))

    def add_fixed(section: str, key: str) -> None:
        add(section, key, fixed[key])

    add("DATA", "algorithm.adv_estimator", algo.adv_estimator, "algorithm.adv_estimator")
    add("DATA", "algorithm.norm_adv_by_std_in_grpo", algo.norm_adv_by_std_in_grpo, "algorithm.norm_adv_by_std_in_grpo")
    add("DATA", "data.train_files", files, "data.train_files")
    add("DATA", "data.val_files", val_files or files, "data.val_files")
    add("DATA", "data.train_batch_size", r.logical_batch, "recipe.logical_batch")
    add("DATA", "data.max_prompt_length", r.prompt_limit, "recipe.prompt_limit")
    add("DATA", "data.max_response_length", r.response_limit, "recipe.response_limit")
    add("DATA", "data.prompt_key", d.prompt_key, "data.prompt_key")
    add("DATA", "data.filter_overlong_prompts", d.filter_overlong_prompts, "data.filter_overlong_prompts")
    add("DATA", "data.truncation", d.truncation, "data.truncation")
    add("DATA", "data.shuffle", d.shuffle, "data.shuffle")
    add("DATA", "data.seed", d.seed, "data.seed")
    if d.apply_chat_template_kwargs:  # one `+key=value` each, as verl's examples write them
        for name, value in d.apply_chat_template_kwargs.items():
            out.append(
                Override(
                    "DATA", f"data.apply_chat_template_kwargs.{name}", value, ("data.apply_chat_template_kwargs",), "+"
                )
            )
    else:
        add("DATA", "data.apply_chat_template_kwargs", {}, "data.apply_chat_template_kwargs")
    add("DATA", "data.trust_remote_code", m.trust_remote_code, "model.trust_remote_code")
    reward_src = ("reward.custom_reward_function.path", "estimator.use_task_rewards")
    add("DATA", "reward.custom_reward_function.path", reward.path, *reward_src)
    add("DATA", "reward.custom_reward_function.name", reward.name, "reward.custom_reward_function.name")

    lora = (m.lora.r, m.lora.alpha, list(m.lora.target_modules))
    lora_src = (("model.lora.r", "model.lora.enabled"), ("model.lora.alpha",), ("model.lora.target_modules",))
    adapter = None if m.adapter is None else absolute_path(m.adapter, cwd)
    if adapter is not None:  # the adapter's own config decides r, alpha and targets (as in miniverl)
        own = adapter_lora(adapter)
        if own is not None:
            lora, lora_src = own, (("model.adapter",),) * 3
    add("MODEL", f"{MODEL}.path", m.model_id, "model.model_id")
    add("MODEL", f"{MODEL}.tokenizer_path", m.tokenizer_id, "model.tokenizer_id")
    add("MODEL", f"{MODEL}.trust_remote_code", m.trust_remote_code, "model.trust_remote_code")
    add("MODEL", f"{MODEL}.enable_gradient_checkpointing", m.gradient_checkpointing, "model.gradient_checkpointing")
    add("MODEL", f"{MODEL}.lora_rank", lora[0], *lora_src[0])
    add("MODEL", f"{MODEL}.lora_alpha", lora[1], *lora_src[1])
    add("MODEL", f"{MODEL}.target_modules", lora[2], *lora_src[2])
    add("MODEL", f"{MODEL}.lora_adapter_path", adapter, "model.adapter")

    optim = config.actor.optim
    add("ACTOR", f"{ACTOR}.optim.lr", optim.lr, "actor.optim.lr")
    add("ACTOR", f"{ACTOR}.optim.betas", list(optim.betas), "actor.optim.betas")
    add("ACTOR", f"{ACTOR}.optim.weight_decay", optim.weight_decay, "actor.optim.weight_decay")
    add("ACTOR", f"{ACTOR}.optim.override_optimizer_config", {"eps": optim.eps}, "actor.optim.eps")
    add("ACTOR", f"{ACTOR}.optim.clip_grad", config.actor.grad_clip, "actor.grad_clip")
    add("ACTOR", f"{ACTOR}.ppo_epochs", config.actor.ppo_epochs, "actor.ppo_epochs")
    add("ACTOR", f"{ACTOR}.ppo_mini_batch_size", r.logical_batch, "recipe.logical_batch")
    add("ACTOR", f"{ACTOR}.use_dynamic_bsz", x.use_dynamic_bsz, "export.use_dynamic_bsz")
    if x.use_dynamic_bsz:
        tokens = (
            x.max_token_len_per_gpu
            if x.max_token_len_per_gpu is not None
            else VERL_DEFAULTS[f"{ACTOR}.ppo_max_token_len_per_gpu"]
        )
        add("ACTOR", f"{ACTOR}.ppo_max_token_len_per_gpu", tokens, "export.max_token_len_per_gpu")
    else:
        add("ACTOR", f"{ACTOR}.ppo_micro_batch_size_per_gpu", ppo_micro, *micro_src)
    add("ACTOR", f"{ACTOR}.loss_agg_mode", e.loss_agg_mode, "estimator.loss_agg_mode")
    for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c"):  # the task PPO loss's
        add("ACTOR", f"{ACTOR}.{name}", getattr(clip, name), f"actor.{name}")
    add("ACTOR", f"{ACTOR}.fsdp_config.full_determinism", hw.deterministic, "hardware.deterministic")
    add("ACTOR", f"{ACTOR}.fsdp_config.seed", tr.seed, "trainer.seed")

    add("ROLLOUT", f"{ROLLOUT}.name", x.rollout_name, "export.rollout_name")
    add("ROLLOUT", f"{ROLLOUT}.n", config.rollout.n, "rollout.n")
    add_fixed("ROLLOUT", f"{ROLLOUT}.calculate_log_probs")
    add(
        "ROLLOUT",
        "algorithm.rollout_correction.bypass_mode",
        config.algorithm.rollout_correction.bypass_mode,
        "algorithm.rollout_correction.bypass_mode",
    )
    add("ROLLOUT", f"{ROLLOUT}.temperature", config.rollout.temperature, "rollout.temperature")
    add("ROLLOUT", f"{ROLLOUT}.top_p", config.rollout.top_p, "rollout.top_p")
    add("ROLLOUT", f"{ROLLOUT}.top_k", config.rollout.top_k, "rollout.top_k")
    add(
        "ROLLOUT",
        f"{ROLLOUT}.tensor_model_parallel_size",
        x.rollout_tensor_parallel_size,
        "export.rollout_tensor_parallel_size",
    )
    add(
        "ROLLOUT",
        f"{ROLLOUT}.gpu_memory_utilization",
        x.rollout_gpu_memory_utilization,
        "export.rollout_gpu_memory_utilization",
    )
    add("ROLLOUT", f"{ROLLOUT}.max_model_len", max_len, *lengths)
    add("ROLLOUT", f"{ROLLOUT}.log_prob_use_dynamic_bsz", x.use_dynamic_bsz, "export.use_dynamic_bsz")
    if x.use_dynamic_bsz:
        add("ROLLOUT", f"{ROLLOUT}.log_prob_max_token_len_per_gpu", tokens, "export.max_token_len_per_gpu")
    else:
        add("ROLLOUT", f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", log_prob_micro, *log_prob_src)

    add("TRAINER", "trainer.logger", [LOGGERS_TO_VERL[name] for name in tr.logger], "trainer.logger")
    add("TRAINER", "trainer.project_name", tr.project_name, "trainer.project_name")
    add("TRAINER", "trainer.experiment_name", tr.experiment_name, "trainer.experiment_name")
    add("TRAINER", "trainer.nnodes", x.nnodes, "export.nnodes")
    add("TRAINER", "trainer.n_gpus_per_node", x.n_gpus_per_node, "export.n_gpus_per_node")
    add_fixed("TRAINER", "trainer.val_before_train")
    add("TRAINER", "trainer.save_freq", tr.save_freq, "trainer.save_freq")
    add("TRAINER", "trainer.max_actor_ckpt_to_keep", tr.max_actor_ckpt_to_keep, "trainer.max_actor_ckpt_to_keep")
    add("TRAINER", "trainer.resume_mode", tr.resume_mode, "trainer.resume_mode")
    add("TRAINER", "trainer.total_training_steps", r.optimizer_updates, "recipe.optimizer_updates")
    add("TRAINER", "trainer.total_epochs", r.optimizer_updates, "recipe.optimizer_updates")

    add("DISTILLATION", "distillation.enabled", True, "teacher.mode")
    add("DISTILLATION", "distillation.nnodes", x.teacher_nnodes, "export.teacher_nnodes")
    add("DISTILLATION", "distillation.n_gpus_per_node", x.teacher_n_gpus_per_node, "export.teacher_n_gpus_per_node")
    for entry, t, where in teacher_entries(config):
        several = where != "teacher"  # a teacher_models entry verl's YAML does not have: `+`, every key set
        plus = "+" if several else ""
        keys: list[tuple[str, Any, tuple[str, ...]]] = []
        if several:
            keys.append(("key", t.key, (f"{where}.key",)))
        if t.mode == "ref":  # the student's base without its LoRA: a copy of it serves as the teacher
            keys.append(("model_path", m.model_id, (f"{where}.mode", "model.model_id")))
        else:
            keys.append(("model_path", t.model_id, (f"{where}.model_id",)))
        keys += [
            ("num_replicas", x.teacher_replicas, ("export.teacher_replicas",)),
            ("inference.name", x.rollout_name, ("export.rollout_name",)),
            (
                "inference.tensor_model_parallel_size",
                x.teacher_tensor_parallel_size,
                ("export.teacher_tensor_parallel_size",),
            ),
            (
                "inference.gpu_memory_utilization",
                x.teacher_gpu_memory_utilization,
                ("export.teacher_gpu_memory_utilization",),
            ),
            ("inference.max_model_len", max_len, lengths),
        ]
        if several:  # the entry verl ships reads these from the rollout; a new one has its own defaults (512)
            keys.append(("inference.prompt_length", r.prompt_limit, ("recipe.prompt_limit",)))
            keys.append(("inference.response_length", r.response_limit, ("recipe.response_limit",)))
        keys.append(("inference.dtype", t.dtype, (f"{where}.dtype",)))
        keys.append(("inference.temperature", fixed[f"{TEACHER}.inference.temperature"], ("fixed",)))
        out += [Override("DISTILLATION", f"{entry}.{key}", value, sources, plus) for key, value, sources in keys]
    if config.teachers:
        add("DISTILLATION", "distillation.teacher_key", config.teacher_key, "teacher_key")
    add("DISTILLATION", f"{LOSS}.loss_mode", e.loss_mode, "estimator.loss_mode")
    add("DISTILLATION", f"{LOSS}.topk", e.topk, "estimator.topk")
    add("DISTILLATION", f"{LOSS}.use_task_rewards", e.use_task_rewards, "estimator.use_task_rewards")
    coef = e.distillation_loss_coef
    add("DISTILLATION", f"{LOSS}.distillation_loss_coef", coef, "estimator.distillation_loss_coef")
    add("DISTILLATION", f"{LOSS}.use_policy_gradient", e.use_policy_gradient, "estimator.use_policy_gradient")
    add("DISTILLATION", f"{LOSS}.policy_loss_mode", e.policy_loss_mode, "estimator.policy_loss_mode")
    add("DISTILLATION", f"{LOSS}.clip_ratio", e.clip_ratio, "estimator.clip_ratio")
    add("DISTILLATION", f"{LOSS}.clip_ratio_low", e.clip_ratio_low, "estimator.clip_ratio_low")
    add("DISTILLATION", f"{LOSS}.clip_ratio_high", e.clip_ratio_high, "estimator.clip_ratio_high")
    add("DISTILLATION", f"{LOSS}.loss_max_clamp", e.loss_max_clamp, "estimator.loss_max_clamp")
    add("DISTILLATION", f"{LOSS}.log_prob_min_clamp", e.log_prob_min_clamp, "estimator.log_prob_min_clamp")
    return out


# ---------------------------------------------------------------- writing the launch


@dataclass
class ExportResult:
    folder: Path
    overrides: list[Override]
    warnings: list[str] = field(default_factory=list)
    digest: str = ""

    @property
    def lines(self) -> list[str]:
        return [o.line for o in self.overrides]


def check_launch(overrides: list[Override]) -> None:
    """Refuse, with one line, a launch that verl v0.8.0 would refuse at run time."""
    problems = runtime_violations(virtual_verl_config({o.key: o.value for o in overrides}))
    if problems:
        hint = (
            "set the scale with export.* (docs/export.md); batch rows come from recipe.logical_batch and "
            "hardware.update_chunk"
        )
        raise MiniverlError(f"verl v0.8.0 would refuse this launch: {problems[0]} ({hint})")


def export(cfg: DictConfig, folder: Path, *, cwd: Path | None = None) -> ExportResult:
    """Validate `cfg`, build its verl launch, check it as verl would, and write it into `folder`."""
    config = to_config(cfg)
    rules = field_rules(cfg)
    refused = refusal(config)
    if refused:
        raise MiniverlError(refused)
    folder = Path(folder).absolute()
    cwd = Path.cwd() if cwd is None else cwd
    reward = launch_reward(config, folder, cwd)
    overrides = verl_overrides(config, reward=reward, cwd=cwd)
    check_launch(overrides)
    warnings = differences(config)
    for path in next(o.value for o in overrides if o.key == "data.train_files"):
        if not os.path.exists(path):
            warnings.append(
                f"data file {path} does not exist here: the verl trainer must see it at this path "
                "(or set TRAIN_FILES in run_opd.sh)"
            )
    if reward.written is None and not os.path.exists(reward.path):
        warnings.append(f"reward function file {reward.path} does not exist here: the verl trainer must see it there")
    digest = field_rule_digest()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "overrides.txt").write_text("".join(o.line + "\n" for o in overrides))
        script = folder / "run_opd.sh"
        script.write_text(launch_script(config, overrides, digest, reward))
        script.chmod(0o755)
        if reward.written:
            (folder / reward.written).write_text(reward.source)
        (folder / "field_rules.json").write_text(
            json.dumps(rules_document(config, rules, overrides, digest), indent=2, sort_keys=False) + "\n"
        )
        (folder / "README.md").write_text(readme(config, overrides, warnings, digest, reward))
    except OSError as error:
        raise MiniverlError(f"cannot write the verl export into {folder}: {error.strerror}") from None
    return ExportResult(folder, overrides, warnings, digest)
