"""Read a verl launch back into miniverl overrides:
`python -m miniverl.import_verl FILE [-o OUT] [--verl-version 0.9.1|0.8.0]`.

FILE is a launch script in the shape of verl's examples (bash arrays of overrides, `${VAR:-default}`,
`$(( ... ))`, then `python3 -m verl.trainer.main_ppo ...`; it is read, never run) or an overrides
file (one Hydra override per line, like the export's overrides.txt). The result means what the verl
launch means on that release (0.9.1 by default): a key the launch leaves out takes that release's
default. It writes one miniverl override per line for every field that maps
(`miniverl.verl_compat.field_rules`), then, as comments, the verl overrides with no miniverl field,
verl's engine settings (how verl runs, not what it computes) and the miniverl fields verl does not
set. Apply it on top of a recipe:

    python -m miniverl.main +recipe=opd_k1 $(grep -v '^#' OUT)

export -> import -> export gives the same overrides on every mapped field.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miniverl.config.algorithm import ADV_ESTIMATORS
from miniverl.config.model import ALL_LINEAR
from miniverl.utils.errors import MiniverlError
from miniverl.utils.overrides import hydra_value
from miniverl.verl_compat.defaults import (
    ACTOR,
    FIXED,
    LOGGERS_TO_VERL,
    MODEL,
    ROLLOUT,
    TEACHER,
    TEACHERS,
    verl_defaults,
)
from miniverl.verl_compat.field_rules import RULES, table_read
from miniverl.verl_compat.import_render import render
from miniverl.verl_compat.launch_files import NO_TASK_REWARD_FILE, TASK_REWARD_FILE
from miniverl.verl_compat.launch_reader import exported_for, read_overrides, release_note
from miniverl.verl_compat.not_imported import ENGINE_WHY, NOT_IN_MINIVERL, REFUSED_WHY, why_not_imported
from miniverl.verl_compat.overrides import get, virtual_verl_config
from miniverl.verl_compat.runtime_checks import runtime_violations
from miniverl.verl_compat.versions import EXPORT_DEFAULT, PROFILE_VERSION, release

# ---------------------------------------------------------------- verl -> miniverl


def parse(lines: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Hydra-parse the overrides: ({key: value}, [config-group choices and deletions, as written])."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    values: dict[str, Any] = {}
    other: list[str] = []
    for line in lines:
        try:
            (override,) = parser.parse_overrides([line])
        except OverrideParseException:
            other.append(line)
            continue
        key = override.key_or_group
        if override.is_delete() or override.is_sweep_override() or "." not in key or "@" in key:
            other.append(line)
            continue
        values[key] = override.value()
    return values, other


def to_miniverl(lines: list[str], version: str = EXPORT_DEFAULT) -> tuple[list[tuple[str, Any]], list[tuple[str, str]]]:
    """(miniverl overrides [(field, value)], verl overrides with no miniverl field [(line, why)]) of a
    launch for verl `version`; verl's engine settings are among the second, with ENGINE_WHY."""
    values, other = parse(lines)
    unmapped: list[tuple[str, str]] = [
        (
            line,
            ENGINE_WHY
            if line.startswith("model_engine=")
            else "not a plain key=value override (a config-group choice, a deletion, a sweep, or a shell command "
            "left unrun)",
        )
        for line in other
    ]
    defaults = verl_defaults(version)
    known = {key for key in values if key in defaults or _dict_parent(key) is not None}
    cfg = virtual_verl_config({k: v for k, v in values.items() if k in known}, version)
    v = lambda key: get(cfg, key)  # noqa: E731  (the launch's value, or verl's default)
    used: set[str] = set()
    out: list[tuple[str, Any]] = []

    def emit(fieldname: str, value: Any, *keys: str) -> None:
        out.append((fieldname, value))
        used.update(keys)

    def skip(key: str, why: str) -> None:
        if key in values:
            unmapped.append((f"{key}={hydra_value(values[key])}", why))
        used.add(key)

    if not v("distillation.enabled"):
        raise MiniverlError(
            "this verl launch does not enable distillation (distillation.enabled=True): it is not "
            "on-policy distillation and has no miniverl equivalent"
        )
    entries = dict.fromkeys(k.split(".")[2] for k in values if k.startswith(f"{TEACHERS}."))  # launch order
    named = [name for name in entries if name != "teacher_model"]
    several = len(named) > 1
    if named:  # verl drops teacher_model then, and serves the named entries
        for key in [k for k in values if k.startswith(f"{TEACHER}.")]:
            unmapped.append((f"{key}={hydra_value(values.pop(key))}", "verl drops teacher_model beside other teachers"))
        # The scale (export.teacher_*) is one for all teachers in miniverl: read off the first entry.
        first = f"{TEACHERS}.{named[0]}."
        copied = {f"{TEACHER}.{k[len(first) :]}": val for k, val in values.items() if k.startswith(first)}
        values.update(copied)
        used.update(k for k in values if k.startswith(f"{TEACHERS}."))  # read as `teachers`, or via the copy
        known = {key for key in values if key in defaults or _dict_parent(key) is not None}
        cfg = virtual_verl_config({k: val for k, val in values.items() if k in known}, version)
    if v(f"{TEACHER}.model_path") is None:
        raise MiniverlError(f"this verl launch sets no {TEACHER}.model_path: there is no teacher to import")
    emit("estimator", v("distillation.distillation_loss.loss_mode"))  # the group; its fields follow
    emit("export.verl_version", version)  # exported again, the launch is for the same release
    for rule in table_read(version):  # every rule the table maps one to one; the rest below, each for its reason
        if v(rule.verl_keys[0]) == "???":  # verl's mandatory value, left unset: the recipe's stays (refused below)
            used.update(rule.verl_keys)
            continue
        emit(rule.field, v(rule.verl_keys[0]), *rule.verl_keys)
        for key in rule.verl_keys[1:]:  # one miniverl field, several verl keys: they must agree
            if v(key) != v(rule.verl_keys[0]):
                unmapped.append(
                    (
                        f"{key}={hydra_value(v(key))}",
                        f"differs from {rule.verl_keys[0]}="
                        f"{hydra_value(v(rule.verl_keys[0]))}; miniverl has one field, {rule.field}",
                    )
                )
    agg = v(f"{ACTOR}.loss_agg_mode")
    if agg not in release(version).loss_agg_modes:  # token-sum in a 0.8.0 launch: verl refuses it
        out[:] = [(name, value) for name, value in out if name != "estimator.loss_agg_mode"]
        unmapped.append(
            (f"{ACTOR}.loss_agg_mode={agg}", f"not a loss_agg_mode of verl {version}: it refuses the launch")
        )
    # verl fills a single teacher's pool with as many replicas as fit (DistillationConfig).
    inference = f"{TEACHER}.inference"
    per_replica = v(f"{inference}.tensor_model_parallel_size") * v(f"{inference}.data_parallel_size")
    per_replica *= v(f"{inference}.pipeline_model_parallel_size") or 1
    pool = v("distillation.nnodes") * v("distillation.n_gpus_per_node")
    replicas = pool // per_replica
    if replicas == 0 and not several:  # no teacher replica on the pool: verl refuses it (listed), the recipe's stays
        out[:] = [(name, value) for name, value in out if not name.startswith("export.teacher_")]
        unmapped.append(
            (
                f"distillation.nnodes={hydra_value(v('distillation.nnodes'))}, "
                f"n_gpus_per_node={hydra_value(v('distillation.n_gpus_per_node'))}",
                ("no GPU for the teacher's pool" if pool == 0 else f"a pool of {pool} GPUs holds no teacher replica "
                 f"of {per_replica} (tensor x data x pipeline parallel)")
                + ": the recipe's export.teacher_* kept; set them before exporting again",
            )
        )  # fmt: skip
    else:
        emit("export.teacher_replicas", replicas, f"{TEACHER}.num_replicas")
    given = values.get(f"{TEACHER}.num_replicas")
    if not several and given is not None and given != replicas:
        unmapped.append(
            (
                f"{TEACHER}.num_replicas={hydra_value(given)}",
                f"verl sets a single teacher's replicas from distillation.nnodes x n_gpus_per_node: imported as "
                f"{replicas}",
            )
        )
    for rule in RULES:
        if rule.status == "fixed_in_verl":
            emit(rule.field, rule.verl_value)
    emit("teacher.mode", "ref" if same_base(v(f"{TEACHER}.model_path"), v(f"{MODEL}.path")) else "standard",
         "distillation.enabled")  # fmt: skip
    for block in ("model", "teacher"):  # verl loads the hub's head of the path it names: no recipe's pin
        out += [(f"{block}.revision", None), (f"{block}.tokenizer_revision", None)]
    if several:
        out[:] = [(name, value) for name, value in out if not name.startswith("teacher.")]  # `teachers` instead
        out.extend(several_teachers(values, named, v(f"{MODEL}.path"), unmapped))
        emit("export.teacher_replicas", values.get(f"{TEACHER}.num_replicas"), f"{TEACHER}.num_replicas")
    emit("recipe.prompt_limit", v("data.max_prompt_length"), "data.max_prompt_length")
    emit("recipe.response_limit", v("data.max_response_length"), "data.max_response_length")
    # Task advantages: verl's critic-free outcome estimators only.
    estimator = v("algorithm.adv_estimator")
    if estimator in ADV_ESTIMATORS:
        emit("algorithm.adv_estimator", estimator, "algorithm.adv_estimator")
    else:
        why = f"miniverl has verl's {' and '.join(ADV_ESTIMATORS)} only (gae needs a critic)"
        skip("algorithm.adv_estimator", why)
        if "algorithm.adv_estimator" not in values:
            unmapped.append((f"algorithm.adv_estimator={estimator} (verl's default)", why))
    # The task reward: the export's own scorer files mean miniverl's own rules.
    path = v("reward.custom_reward_function.path")
    if path is not None and _written_by_the_export(path):
        unmapped.append(
            (
                f"reward.custom_reward_function.path={path}",
                "the export's own scorer: imported as null, miniverl's rules (they score as it does)",
            )
        )
        path = None
    emit("reward.custom_reward_function.path", path, "reward.custom_reward_function.path")
    # LoRA: miniverl trains LoRA adapters only.
    rank = v(f"{MODEL}.lora_rank")
    if rank and rank > 0:
        emit("model.lora.r", rank, f"{MODEL}.lora_rank")
    else:
        skip(f"{MODEL}.lora_rank", "full fine-tuning: miniverl trains LoRA adapters only")
        if f"{MODEL}.lora_rank" not in values:
            unmapped.append(
                (f"{MODEL}.lora_rank=0 (verl's default)", "full fine-tuning: miniverl trains LoRA adapters only")
            )
    targets = v(f"{MODEL}.target_modules")  # verl's default all-linear when the launch sets none
    if isinstance(targets, list) or targets == ALL_LINEAR:
        emit("model.lora.target_modules", targets, f"{MODEL}.target_modules")
    else:
        skip(f"{MODEL}.target_modules", f"{targets!r}: miniverl takes a list of layer names or {ALL_LINEAR}")
    # Loggers: console, file (jsonl), tensorboard, wandb (verl's default: console and wandb).
    back = {verl: ours for ours, verl in LOGGERS_TO_VERL.items()}
    loggers = v("trainer.logger")
    loggers = [loggers] if isinstance(loggers, str) else list(loggers or [])
    emit("trainer.logger", [back[name] for name in loggers if name in back], "trainer.logger")
    for name in loggers:
        if name not in back:
            unmapped.append((f"trainer.logger: {name}", "miniverl logs to console, jsonl, tensorboard and wandb only"))
    # AdamW eps rides in override_optimizer_config.
    extra = dict(v(f"{ACTOR}.optim.override_optimizer_config") or {})
    emit("actor.optim.eps", float(extra.pop("eps", 1e-8)), f"{ACTOR}.optim.override_optimizer_config")
    if extra:
        unmapped.append(
            (f"{ACTOR}.optim.override_optimizer_config: {extra}", "optimizer arguments miniverl does not have")
        )
    # Data.
    files, val = ([f] if isinstance(f, str) else list(f) for f in (v("data.train_files"), v("data.val_files")))
    emit("data.train_files", files, "data.train_files")
    emit("data.val_files", [] if val == files else val, "data.val_files")  # the train files: none held out
    steps = v("trainer.total_training_steps")
    if steps is None:
        unmapped.append(
            (
                f"trainer.total_epochs={hydra_value(v('trainer.total_epochs'))} and no trainer.total_training_steps",
                "verl runs whole epochs over the data; miniverl needs a number of updates: set "
                "recipe.optimizer_updates",
            )
        )
        used.add("trainer.total_epochs")
    else:
        emit("recipe.optimizer_updates", steps, "trainer.total_training_steps")
    if steps is None or v("trainer.total_epochs") == steps:
        used.add("trainer.total_epochs")
    else:
        skip("trainer.total_epochs", "an upper bound only: miniverl runs recipe.optimizer_updates updates")
    # Micro-batches and the token budget.
    dynamic = v(f"{ACTOR}.use_dynamic_bsz")
    if dynamic:
        emit(
            "export.max_token_len_per_gpu",
            v(f"{ACTOR}.ppo_max_token_len_per_gpu"),
            f"{ACTOR}.ppo_max_token_len_per_gpu",
            f"{ROLLOUT}.log_prob_max_token_len_per_gpu",
        )
        skip(f"{ACTOR}.ppo_micro_batch_size_per_gpu", "unused with use_dynamic_bsz")
        skip(f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", "unused with use_dynamic_bsz")
    else:
        micro, log_prob = v(f"{ACTOR}.ppo_micro_batch_size_per_gpu"), v(f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu")
        if micro is not None:
            emit("hardware.update_chunk", micro, f"{ACTOR}.ppo_micro_batch_size_per_gpu")
        if log_prob is not None and log_prob != micro:
            emit("export.log_prob_micro_batch_size_per_gpu", log_prob, f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu")
        used.add(f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu")
        skip(f"{ACTOR}.ppo_max_token_len_per_gpu", "unused without use_dynamic_bsz")
        skip(f"{ROLLOUT}.log_prob_max_token_len_per_gpu", "unused without use_dynamic_bsz")
    # Derived keys: checked for consistency, not imported.
    for key in (f"{ROLLOUT}.max_model_len", f"{TEACHER}.inference.max_model_len", f"{ACTOR}.loss_scale_factor"):
        used.add(key)
    scale, limit = v(f"{ACTOR}.loss_scale_factor"), v("data.max_response_length")  # read by one mode alone
    padded = limit if version == "0.8.0" else None  # without it: 0.9.1's V1 trainer pads each micro-batch its own
    if v(f"{ACTOR}.loss_agg_mode") == "seq-mean-token-sum-norm" and (scale or padded) != limit:
        divisor = hydra_value(scale) if scale is not None else "each micro-batch's longest response"
        why = f"verl divides by {divisor}; miniverl's seq-mean-token-sum-norm by recipe.response_limit"
        unmapped.append((f"{ACTOR}.loss_scale_factor={hydra_value(scale)}", why))
    # The keys the export writes because of what the recipe is.
    forced = release(version).teacher_temperature_forced  # 0.9: any teacher temperature runs as 1.0
    for key, value, why in FIXED:
        used.add(key)
        if key in values and values[key] != value and not (forced and key == f"{TEACHER}.inference.temperature"):
            unmapped.append((f"{key}={hydra_value(values[key])}", f"miniverl means {hydra_value(value)}: {why}"))
    inherited = v(f"{TEACHER}.inference.temperature")  # verl's default follows the rollout's temperature
    if f"{TEACHER}.inference.temperature" not in values and inherited != 1.0 and not forced:
        unmapped.append(
            (
                f"{TEACHER}.inference.temperature={hydra_value(inherited)}",
                f"inherited from {ROLLOUT}.temperature: verl {version} refuses a teacher temperature other than 1.0 "
                f"at start-up, so this launch does not run there; miniverl scores the teacher at 1.0",
            )
        )
    # Settings that agree with miniverl when off: read, nothing to import.
    for key, why in NOT_IN_MINIVERL.items():
        if values.get(key):
            unmapped.append((f"{key}={hydra_value(values[key])}", why))
        used.add(key)
    for key, value in values.items():
        if key not in used and _dict_parent(key) not in used:
            unmapped.append((f"{key}={hydra_value(value)}", why_not_imported(key, version)))
    unmapped += [(line, REFUSED_WHY) for line in runtime_violations(cfg, version)]
    # One line per field (the last value wins), the estimator group first, then in the rules' order.
    final = dict(out)
    order = {"estimator": -1, **{rule.field: k for k, rule in enumerate(RULES)}}
    return sorted(final.items(), key=lambda item: order.get(item[0], len(order))), unmapped


def same_base(teacher_path: Any, student_path: Any) -> bool:
    """The student's own base as the teacher (miniverl's mode=ref); two toy templates (`toy`) are two models."""
    return teacher_path == student_path and teacher_path != "toy"


def several_teachers(
    values: dict[str, Any], names: list[str], student_path: Any, unmapped: list[tuple[str, str]]
) -> list[tuple[str, Any]]:
    """`teachers.<name>` for each distillation.teacher_models.<name> entry: its key, model and dtype
    on the recipe's teacher option; a scale that differs from the first teacher's is listed, since
    miniverl's export gives every teacher the same (export.teacher_*)."""
    out: list[tuple[str, Any]] = []
    scale = ("num_replicas", "inference.tensor_model_parallel_size", "inference.gpu_memory_utilization")
    first = {key: values.get(f"{TEACHERS}.{names[0]}.{key}") for key in scale}
    for name in names:

        def entry(key: str, name: str = name) -> Any:
            return values.get(f"{TEACHERS}.{name}.{key}")

        path = entry("model_path")
        where = f"teachers.{name}"
        out += [
            (f"+teacher@{where}", "qwen3_1_7b"),  # the recipe's teacher option (NF4); its model is set next
            (f"{where}.key", entry("key")),
            (f"{where}.mode", "ref" if same_base(path, student_path) else "standard"),
            (f"{where}.model_id", path),
            (f"{where}.revision", None),
        ]
        if entry("inference.dtype") is not None:
            out.append((f"{where}.dtype", entry("inference.dtype")))
        for key in scale:
            if entry(key) != first[key]:
                unmapped.append(
                    (
                        f"{TEACHERS}.{name}.{key}={hydra_value(entry(key))}",
                        f"differs from {names[0]}'s {hydra_value(first[key])}: miniverl's export gives every "
                        "teacher the same scale (export.teacher_*)",
                    )
                )
    return out


def _written_by_the_export(path: str) -> bool:
    """A reward file of the export's (by its name, and by its header when it can be read here)."""
    if Path(path).name not in (NO_TASK_REWARD_FILE, TASK_REWARD_FILE):
        return False
    try:
        return Path(path).read_text().startswith('"""Written by miniverl\'s export')
    except OSError:  # not on this machine (the launch was made elsewhere): trust the name
        return True


def _dict_parent(key: str) -> str | None:
    """The free-form dict key of verl's defaults that `key` lies under (data.apply_chat_template_kwargs,
    reward.custom_reward_function.reward_kwargs: the same in every release)."""
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:end])
        if isinstance(verl_defaults(PROFILE_VERSION).get(parent), dict):
            return parent
    return None


def import_file(path: str | Path, env: Mapping[str, str] | None = None, version: str | None = None) -> str:
    """The miniverl overrides of a launch for verl `version`; None: the release miniverl's export wrote it
    for (its field_rules.json beside it, or run_opd.sh's header), else the export's default."""
    note = release_note(path, version)
    version = version or exported_for(path) or EXPORT_DEFAULT
    mapped, unmapped = to_miniverl(read_overrides(path, env), version)
    return render(str(path), mapped, unmapped, version, note)
