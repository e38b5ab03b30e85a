"""Typed configuration: one schema module per config group, composed into `MiniverlConfig`.

The root schema is registered in Hydra's ConfigStore as `config_schema` and is the first entry of
`conf/config.yaml`'s defaults list, so a wrong key or type anywhere fails at composition with
Hydra's own message. Cross-field rules (the ones verl checks at run time) run in
`__post_init__` when the composed config is turned into these dataclasses (`to_config`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from miniverl.config.actor import ActorConfig, RolloutConfig
from miniverl.config.algorithm import AlgorithmConfig
from miniverl.config.data import DataConfig
from miniverl.config.estimator import EstimatorConfig
from miniverl.config.export import ExportConfig
from miniverl.config.hardware import HardwareConfig
from miniverl.config.model import StudentConfig, real_model_path
from miniverl.config.recipe import RecipeConfig
from miniverl.config.reward import RewardConfig
from miniverl.config.teacher import TeacherConfig, check_teachers
from miniverl.config.trainer import TrainerConfig
from miniverl.config.validation import ValidationConfig


@dataclass
class MiniverlConfig:
    # The student: its weights, precision, LoRA (conf/model/, verl: actor_rollout_ref.model).
    model: StudentConfig = field(default_factory=StudentConfig)
    # The frozen teacher that scores the student's samples (conf/teacher/, verl: distillation.teacher_models).
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    # Several teachers routed by a data column (verl: distillation.teacher_models, .teacher_key):
    # `+teacher@teachers.<name>=<option>` each; empty: `teacher` alone scores every row.
    teachers: dict[str, TeacherConfig] = field(default_factory=dict)
    # The parquet column whose value picks a row's teacher when `teachers` holds several (verl:
    # distillation.teacher_key).
    teacher_key: str = "data_source"
    default_teacher: Optional[str] = None  # miniverl: the teacher of rows whose key matches none (verl refuses them)
    # The distillation loss (conf/estimator/, verl: distillation.distillation_loss).
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    # Where the run executes and how work is split into forwards there (conf/hardware/).
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    # The prompts (verl-format parquet) and how they are read (conf/data/, verl: data.*).
    data: DataConfig = field(default_factory=DataConfig)
    # Seed, loggers, checkpoints, stop and resume (conf/trainer/, verl: trainer.*).
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # The student's optimizer and update (verl: actor_rollout_ref.actor.*).
    actor: ActorConfig = field(default_factory=ActorConfig)
    # How the student samples (verl: actor_rollout_ref.rollout.*).
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # Task advantages and the old-log-prob source (verl: algorithm.*).
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    # The task reward, read only with estimator.use_task_rewards=true (verl: reward.*).
    reward: RewardConfig = field(default_factory=RewardConfig)
    # The numbers of an experiment: batch, updates, lengths, the resume check; +recipe=<name> sets them.
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    # The scale of the verl launch `python -m miniverl.export` writes (conf/export/); training never reads it.
    export: ExportConfig = field(default_factory=ExportConfig)
    # The held-out measurement of distillation progress (never changes training).
    eval: ValidationConfig = field(default_factory=ValidationConfig)

    @property
    def teacher_blocks(self) -> dict[str, TeacherConfig]:
        """Every teacher of the run by name: `teachers`, or the single `teacher` as "teacher"."""
        return dict(self.teachers) if self.teachers else {"teacher": self.teacher}

    @property
    def routed(self) -> bool:
        """Several teachers: each row goes to the teacher whose key its teacher_key column holds. A
        `teachers` block of one scores every row, whatever its key (as verl serves a single entry)."""
        return len(self.teachers) > 1

    def teacher_where(self, name: str) -> str:
        """The config path of a teacher (`teacher` or `teachers.<name>`), for messages."""
        return f"teachers.{name}" if self.teachers else "teacher"

    def __post_init__(self) -> None:
        for name, block in self.teacher_blocks.items():  # every teacher the run reads
            block.check(self.teacher_where(name))
        check_teachers(self.teachers, self.teacher_key, self.default_teacher)
        self.check_text_alignment()
        if self.eval.every != -1 and not self.data.val_files:
            raise ValueError(
                "eval.every is set but data.val_files is empty: give the held-out prompts "
                "(data.val_files=<parquet>) or set eval.every=-1"
            )
        stop = self.trainer.stop_after_updates
        if stop is not None and stop >= self.recipe.optimizer_updates:
            raise ValueError(
                f"trainer.stop_after_updates={stop} must be below recipe.optimizer_updates="
                f"{self.recipe.optimizer_updates}"
            )
        response_key, response = self.longest_response()
        for where, block, limit_key, limit in self.prompt_limits():  # a folder's: the pre-flight reads its config
            if block.model_id == "toy" and block.toy.max_position_embeddings < limit + response:
                raise ValueError(
                    f"{where}.toy.max_position_embeddings={block.toy.max_position_embeddings} is below "
                    f"{limit_key} + {response_key} = {limit + response}"
                )

    def longest_response(self) -> tuple[str, int]:
        """The key and value of the longest response a model reads: recipe.response_limit, or the held-out
        probe's eval.response_limit where the probe runs and samples longer ones."""
        probe = self.eval.response_limit if self.eval.every != -1 else None
        if probe is not None and probe > self.recipe.response_limit:
            return "eval.response_limit", probe
        return "recipe.response_limit", self.recipe.response_limit

    def prompt_limits(self) -> list[tuple[str, StudentConfig | TeacherConfig, str, int]]:
        """(config path, block, the key of its prompt limit, that limit) of the student and every teacher:
        each model reads at most that many prompt tokens and the longest response (longest_response) more."""
        limits = [("model", self.model, "recipe.prompt_limit", self.recipe.prompt_limit)]
        for name, teacher in self.teacher_blocks.items():  # a teacher's context may have its own limit
            where, own = self.teacher_where(name), teacher.context.prompt_limit
            key = f"{where}.context.prompt_limit" if own else "recipe.prompt_limit"
            limits.append((where, teacher, key, own or self.recipe.prompt_limit))
        return limits

    def check_text_alignment(self) -> None:
        """A teacher with another tokenizer scores spans of text, not the student's ids: only the
        sampled-token estimators and a single teacher read span values (docs/teachers.md)."""
        aligned = [self.teacher_where(n) for n, t in self.teacher_blocks.items() if t.text_aligned]
        if not aligned:
            return
        where, est = aligned[0], self.estimator
        if self.teachers:
            raise ValueError(
                f"{where}.tokenizer_alignment=text works with the single `teacher`, not with teachers.<name>: "
                "set it on `teacher` and drop the teachers block"
            )
        if est.use_task_rewards:
            raise ValueError(
                f"{where}.tokenizer_alignment=text and estimator.use_task_rewards=true do not combine yet (the task "
                "loss would skip the unaligned tokens): set estimator.use_task_rewards=false"
            )
        if est.uses_topk or est.uses_full_vocab:
            raise ValueError(
                f"{where}.tokenizer_alignment=text scores sampled tokens only; estimator={est.loss_mode} compares "
                "whole vocabularies, which differ between the two tokenizers: use estimator=k1 (or k3, k2, abs)"
            )
        if est.token_selection.by != "none":
            raise ValueError(
                f"{where}.tokenizer_alignment=text and estimator.token_selection.by={est.token_selection.by} do not "
                "combine (a selection of tokens would cut spans): set estimator.token_selection.by=none"
            )


def register_configs() -> None:
    ConfigStore.instance().store(name="config_schema", node=MiniverlConfig)
    OmegaConf.register_new_resolver("real_model", real_model_path, replace=True)


# The running entry point's verl key hints (verl key -> its fix), set by utils/hydra_entry.one_line_hydra_errors
# from verl_compat's field rules, which import this package: read by the unknown-key line below and the sweep's
# one-line errors.
ENTRY_VERL_HINTS: list[Callable[[], dict[str, str]] | None] = []


def verl_hint(key: str) -> str | None:
    """The running entry point's fix for verl's `key` typed as a miniverl key, if it has one."""
    hints = ENTRY_VERL_HINTS[0] if ENTRY_VERL_HINTS else None
    return hints().get(key) if hints else None


# Names other programs give what miniverl keys otherwise, which no spelling distance finds (peft's and verl's
# rank, transformers' generate and Trainer, TRL's trainers): the last part of a key as typed -> miniverl's key.
OTHER_PROGRAMS_NAMES = {
    "rank": "model.lora.r",
    "lora_rank": "model.lora.r",
    "learning_rate": "actor.optim.lr",
    "max_new_tokens": "recipe.response_limit",
    "max_completion_length": "recipe.response_limit",
    "batch_size": "recipe.logical_batch",
    "per_device_train_batch_size": "recipe.logical_batch",
    "max_steps": "recipe.optimizer_updates",
    "num_generations": "rollout.n",
    "model_name_or_path": "model.model_id",
    "teacher_model_name_or_path": "teacher.model_id",
}


@functools.cache
def schema_keys() -> tuple[str, ...]:
    """Every key of miniverl's config schema, dotted (model.lora.r)."""

    def walk(node: dict, prefix: str):
        for k, v in node.items():
            yield from walk(v, f"{prefix}{k}.") if isinstance(v, dict) and v else (f"{prefix}{k}",)

    return tuple(walk(OmegaConf.to_container(OmegaConf.structured(MiniverlConfig), resolve=False), ""))


def unknown_key_fix(full_key: str, node_keys: list[str]) -> str:
    """What to type for `full_key`, a key its node (with `node_keys`) lacks: the node's closest key, the
    same name a level off (actor.lr: actor.optim.lr), miniverl's key for another program's name, or
    the node's keys."""
    import difflib

    parent, _, key = full_key.rpartition(".")
    prefix = parent + "." if parent else ""
    close = difflib.get_close_matches(key, node_keys, n=1)
    elsewhere = [k for k in schema_keys() if k.rsplit(".", 1)[-1] == key and k.startswith(prefix)]
    if close:
        return f"did you mean {prefix}{close[0]}?"
    if len(elsewhere) == 1:
        return f"did you mean {elsewhere[0]}?"
    if key in OTHER_PROGRAMS_NAMES:  # the node's own key of that name first: teacher.model_id, eval.response_limit
        here = prefix + OTHER_PROGRAMS_NAMES[key].rsplit(".", 1)[-1]
        return f"did you mean {here if here in schema_keys() else OTHER_PROGRAMS_NAMES[key]}?"
    return f"{parent or 'the top level'} has {', '.join(k for k in node_keys if k != 'hydra')}"


def unknown_key_line(full_key: str) -> str:
    """A key the schema lacks (forced in with `+key=value`, or by a recipe), and what to type instead."""
    parent = full_key.rpartition(".")[0]
    schema = OmegaConf.structured(MiniverlConfig)
    node = OmegaConf.select(schema, parent) if parent else schema
    keys = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
    fix = verl_hint(full_key) or unknown_key_fix(full_key, keys)  # verl's own key, forced in with +key=value
    where = f"the {parent} node" if parent else "the top level"
    return f"unknown config key {full_key}: the schema ({where}) has no such key; {fix}"


def to_config(cfg: DictConfig) -> MiniverlConfig:
    """Validate a composed config: runs every schema's `__post_init__`; a refused value becomes a
    one-line MiniverlError."""
    from omegaconf.errors import ConfigKeyError, InterpolationResolutionError

    from miniverl.utils.errors import MiniverlError

    plain = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    try:
        # Re-merging into the bare schema catches keys forced in with `+key=value`.
        checked = OmegaConf.merge(OmegaConf.structured(MiniverlConfig), OmegaConf.to_container(plain))
    except ConfigKeyError as error:
        raise MiniverlError(unknown_key_line(error.full_key or "")) from None
    try:
        return OmegaConf.to_object(checked)
    except InterpolationResolutionError as error:  # a ${...} in a value: named by the key that holds it
        raise MiniverlError(
            f"{error.full_key}: {str(error).splitlines()[0]}; a ${{...}} names a config key as `--cfg job` prints it, "
            "or a set environment variable (${oc.env:VAR})"
        ) from None
    except (ValueError, NotImplementedError) as error:
        raise MiniverlError(str(error).splitlines()[0]) from None


register_configs()
