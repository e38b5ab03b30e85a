"""Export a recipe as a real verl launch (the release of `export.verl_version`: 0.9.1 by default, or
0.8.0; miniverl/verl_compat/versions.py): the library behind `python -m miniverl.export
+recipe=opd_k1 [overrides]` (miniverl/export.py, a Hydra app like `miniverl.main`: the same config,
the same overrides). It writes, in the command's run folder,

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
report: `field_rule_digest()` is the sha256 of the canonical rule table of the profile's release
(v0.8.0); an export's own identity is the digest of its release's table.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from miniverl.config import MiniverlConfig, to_config
from miniverl.utils.dataset import locate, read_conversations
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import resolved_config, sha256_file, sha256_json
from miniverl.utils.tables import flatten
from miniverl.verl_compat.carry_over import adapter_lora, differences, refusal, teacher_entries
from miniverl.verl_compat.defaults import (
    ACTOR,
    FIXED,
    LOGGERS_TO_VERL,
    MODEL,
    ROLLOUT,
    TEACHER,
    VERL_DEFAULTS,
)
from miniverl.verl_compat.field_rules import TEACHER_ENTRY, rule_for, rule_table, table_written
from miniverl.verl_compat.launch_files import (
    SECTIONS,
    LaunchReward,
    Override,
    absolute_path,
    launch_reward,
    launch_script,
    local_model_path,
    readme,
    resolved_flat,
    rules_document,
)
from miniverl.verl_compat.overrides import virtual_verl_config
from miniverl.verl_compat.runtime_checks import runtime_violations
from miniverl.verl_compat.versions import PROFILE_VERSION, REWARD_KWARGS, release

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


def field_rules(cfg: DictConfig | MiniverlConfig | dict | None = None, version: str = PROFILE_VERSION) -> list[dict]:
    """The canonical rule of every miniverl field for verl `version` (sorted by field). With `cfg`, also
    checks that each field of that resolved config has a rule, and refuses with the ones that have none."""
    if cfg is not None:
        missing = [path for path in config_fields(cfg) if rule_for(path) is None]
        if missing:
            raise MiniverlError(
                f"no verl field rule for {', '.join(missing)} (add one to miniverl/verl_compat/field_rules/)"
            )
    return rule_table(version)["fields"]


def field_rule_digest(table: Any = None, version: str = PROFILE_VERSION) -> str:
    """sha256 of the canonical JSON of the rule table (field rules + the keys the recipe fixes, with
    the verl version they target): the report's `profile_identity.field_rule_digest`. The table does
    not depend on a config, so `field_rule_digest()` and `field_rule_digest(cfg)` agree; pass a rule
    table (a dict with "fields") to hash that one instead, or a `version` for that release's table."""
    return sha256_json(table if isinstance(table, dict) and "fields" in table else rule_table(version))


# ---------------------------------------------------------------- the overrides


# The section of run_opd.sh a verl key goes into (the first prefix that matches).
SECTION_OF_PREFIX = (
    ("algorithm.rollout_correction.", "ROLLOUT"),
    ("data.", "DATA"),
    ("algorithm.", "DATA"),
    ("reward.", "DATA"),
    (f"{MODEL}.", "MODEL"),
    (f"{ACTOR}.", "ACTOR"),
    (f"{ROLLOUT}.", "ROLLOUT"),
    ("trainer.", "TRAINER"),
    ("distillation.", "DISTILLATION"),
)


def section_of(key: str) -> str:
    for prefix, section in SECTION_OF_PREFIX:
        if key.startswith(prefix):
            return section
    raise MiniverlError(f"export: verl key {key} has no section of run_opd.sh (launch_writer.SECTION_OF_PREFIX)")


def verl_overrides(config: MiniverlConfig, *, reward: LaunchReward, cwd: Path) -> list[Override]:
    """The verl overrides that run `config` on `export.verl_version`: every key the rule table maps as identity
    (`table_written`), the keys of the fixed table (`FIXED`), then the exceptions below (the fields
    of field_rules.EXPORTED_BY_CODE and the rules whose transform is code); grouped by run_opd.sh's
    sections, in that order within each."""
    m, d, r, x, hw = config.model, config.data, config.recipe, config.export, config.hardware
    verl = release(x.verl_version)
    values = resolved_flat(config)  # {field: value}: every table field is a leaf
    for name in ("model.model_id", "model.tokenizer_id"):  # a local folder: absolute, as the data files
        values[name] = local_model_path(values[name], cwd)
    out = [
        Override(section_of(key), key, values[name], (name,), "+" if key in verl.defaults_outside_yaml else "")
        for name, key in table_written(verl.version)
    ]

    def add(key: str, value: Any, *sources: str, prefix: str = "") -> None:
        out.append(Override(section_of(key), key, value, sources or ("fixed",), prefix))

    fixed = {key: value for key, value, _ in FIXED}
    for key, value in fixed.items():  # what the recipe is; the teacher's temperature goes into each teacher entry
        if not key.startswith(TEACHER_ENTRY):
            add(key, value)
    # Paths: absolute, so the launch runs from any folder; no held-out files: verl validates on the train files.
    files = [absolute_path(str(locate(p)), cwd) for p in d.train_files]  # the shipped prompts: their checkout's
    val_files = [absolute_path(str(locate(p)), cwd) for p in getattr(d, "val_files", None) or []]
    add("data.train_files", files, "data.train_files")
    add("data.val_files", val_files or files, "data.val_files")
    reward_src = ("reward.custom_reward_function.path", "estimator.use_task_rewards")
    add("reward.custom_reward_function.path", reward.path, *reward_src)
    add("reward.custom_reward_function.name", reward.name, "reward.custom_reward_function.name")
    kwargs = {} if reward.written else dict(config.reward.custom_reward_function.reward_kwargs)  # the user's own only
    add(REWARD_KWARGS, kwargs, REWARD_KWARGS, prefix="+")  # verl's YAML has no such key
    lengths = ("recipe.prompt_limit", "recipe.response_limit")
    add("data.max_prompt_length", r.prompt_limit, "recipe.prompt_limit")
    add("data.max_response_length", r.response_limit, "recipe.response_limit")
    add(f"{ROLLOUT}.max_model_len", r.prompt_limit + r.response_limit + 1, *lengths)
    if config.estimator.loss_agg_mode == "seq-mean-token-sum-norm":
        # Without it verl divides by the padded response width: max_response_length in 0.8.0, each micro-batch's
        # longest response in 0.9.1's default (V1) trainer; miniverl divides by recipe.response_limit.
        add(f"{ACTOR}.loss_scale_factor", r.response_limit, "recipe.response_limit", "estimator.loss_agg_mode")
    if d.apply_chat_template_kwargs:  # one `+key=value` each, as verl's examples write them
        for name, value in d.apply_chat_template_kwargs.items():
            add(f"data.apply_chat_template_kwargs.{name}", value, "data.apply_chat_template_kwargs", prefix="+")
    else:
        add("data.apply_chat_template_kwargs", {}, "data.apply_chat_template_kwargs")
    # LoRA: a starting adapter's own config decides r, alpha and targets (as in miniverl).
    lora = (m.lora.r, m.lora.alpha, m.lora.peft_targets())
    lora_src = (("model.lora.r",), ("model.lora.alpha",), ("model.lora.target_modules",))
    adapter = None if m.adapter is None else absolute_path(m.adapter, cwd)
    if adapter is not None and (own := adapter_lora(adapter)) is not None:
        lora, lora_src = own, (("model.adapter",),) * 3
    for key, value, sources in zip(("lora_rank", "lora_alpha", "target_modules"), lora, lora_src):
        add(f"{MODEL}.{key}", value, *sources)
    add(f"{MODEL}.lora_adapter_path", adapter, "model.adapter")
    add(f"{ACTOR}.optim.override_optimizer_config", {"eps": config.actor.optim.eps}, "actor.optim.eps")
    # Micro-batches: a token budget with dynamic batches, else rows per GPU (hardware.update_chunk by default).
    if x.use_dynamic_bsz:
        tokens = x.max_token_len_per_gpu
        tokens = VERL_DEFAULTS[f"{ACTOR}.ppo_max_token_len_per_gpu"] if tokens is None else tokens
        add(f"{ACTOR}.ppo_max_token_len_per_gpu", tokens, "export.max_token_len_per_gpu")
        add(f"{ROLLOUT}.log_prob_max_token_len_per_gpu", tokens, "export.max_token_len_per_gpu")
    else:
        own_micro = x.ppo_micro_batch_size_per_gpu is not None
        micro = x.ppo_micro_batch_size_per_gpu if own_micro else hw.update_chunk
        micro_src = "export.ppo_micro_batch_size_per_gpu" if own_micro else "hardware.update_chunk"
        add(f"{ACTOR}.ppo_micro_batch_size_per_gpu", micro, micro_src)
        if x.log_prob_micro_batch_size_per_gpu is None:
            add(f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", micro, micro_src)
        else:
            add(
                f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu",
                x.log_prob_micro_batch_size_per_gpu,
                "export.log_prob_micro_batch_size_per_gpu",
            )
    add("trainer.logger", [LOGGERS_TO_VERL[name] for name in config.trainer.logger], "trainer.logger")
    add("trainer.total_training_steps", r.optimizer_updates, "recipe.optimizer_updates")
    add("trainer.total_epochs", r.optimizer_updates, "recipe.optimizer_updates")
    add("distillation.enabled", True, "teacher.mode")
    out += teacher_overrides(config, r.prompt_limit + r.response_limit + 1, fixed, cwd)
    if config.routed:  # one named entry scores every row in verl: no routing key to write
        add("distillation.teacher_key", config.teacher_key, "teacher_key")
    order = {section: i for i, section in enumerate(SECTIONS)}
    return sorted(out, key=lambda o: order[o.section])  # stable: within a section, in the order above


def teacher_overrides(config: MiniverlConfig, max_len: int, fixed: dict, cwd: Path) -> list[Override]:
    """distillation.teacher_models.<name>.*: one entry per teacher, each key read off its own block
    (`teacher`, or `teachers.<name>`) and the export's scale."""
    m, r, x = config.model, config.recipe, config.export
    lengths = ("recipe.prompt_limit", "recipe.response_limit")
    out = []
    for entry, t, where in teacher_entries(config):
        several = where != "teacher"  # a teacher_models entry verl's YAML does not have: `+`, every key set
        keys: list[tuple[str, Any, tuple[str, ...]]] = []
        if several:
            keys.append(("key", t.key, (f"{where}.key",)))
        if t.mode == "ref":  # the student's base without its LoRA: a copy of it serves as the teacher
            keys.append(("model_path", local_model_path(m.model_id, cwd), (f"{where}.mode", "model.model_id")))
        else:
            keys.append(("model_path", local_model_path(t.model_id, cwd), (f"{where}.model_id",)))
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
            # The entry verl ships loads its checkpoint (its YAML: load_format auto); a new one would take
            # the dataclass's "dummy", and vLLM would serve a teacher of random weights.
            keys.append(("inference.load_format", "auto", ("fixed",)))
        keys.append(("inference.dtype", t.dtype, (f"{where}.dtype",)))
        keys.append(("inference.temperature", fixed[f"{TEACHER}.inference.temperature"], ("fixed",)))
        plus = "+" if several else ""
        out += [Override("DISTILLATION", f"{entry}.{key}", value, sources, plus) for key, value, sources in keys]
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


def check_launch(overrides: list[Override], version: str) -> None:
    """Refuse, with one line, a launch that verl `version` would refuse at run time."""
    problems = runtime_violations(virtual_verl_config({o.key: o.value for o in overrides}, version), version)
    if problems:
        hint = (
            "set the scale with export.* (docs/export.md); batch rows come from recipe.logical_batch and "
            "hardware.update_chunk"
        )
        raise MiniverlError(f"verl {version} would refuse this launch: {problems[0]} ({hint})")


WRITTEN_SUMS = "SHA256SUMS"  # what the export wrote, as `sha256sum` writes it (`sha256sum -c` checks it)


def written_unedited(folder: Path) -> dict[str, str]:
    """{name: sha256} of the files an earlier export wrote into `folder` that are still as it wrote them."""
    sums = folder / WRITTEN_SUMS
    lines = sums.read_text().splitlines() if sums.is_file() else []
    entries = (line.split(" ", 1) for line in lines if " " in line)  # `<sha256>  <name>`, or ` *<name>` (binary)
    written = {name.strip().lstrip("*"): digest for digest, name in entries}
    return {n: d for n, d in written.items() if (folder / n).is_file() and sha256_file(folder / n) == d}


def edited_since_written(folder: Path, files: dict[str, str], unedited: dict[str, str]) -> list[str]:
    """The files in `folder` this export would change that an earlier export did not leave as they
    are (`unedited`: written_unedited; a run_opd.sh edited for a cluster, a file of the user's):
    never replaced. An export's own files, unedited, are: the same settings again, or others, write
    a new export over them."""
    changed = [
        name for name, text in files.items() if (folder / name).is_file() and (folder / name).read_text() != text
    ]
    return [name for name in changed if name not in unedited]


def plain_string_prompts(config: MiniverlConfig) -> list[str]:
    """miniverl takes a plain-string prompt as one user message; verl's RLHFDataset hands each prompt to
    the chat template as a message list, which a string is not. A file that cannot be read here is the
    missing-file warning's or the run's to say."""
    found = []
    for key in ("train_files", "val_files"):
        try:
            plain = read_conversations(config.data, key).plain_strings if getattr(config.data, key) else 0
        except MiniverlError:
            continue
        if plain:
            found.append(
                f"data.{key} holds plain-string prompts in {plain} rows (column {config.data.prompt_key!r}): verl "
                "reads each prompt as a list of {role, content} messages, which its chat template needs; store each "
                "as [{'role': 'user', 'content': <the text>}]"
            )
    return found


def export(cfg: DictConfig, folder: Path, *, cwd: Path | None = None) -> ExportResult:
    """Validate `cfg`, build its verl launch, check it as verl would, and write it into `folder`."""
    config = to_config(cfg)
    version = config.export.verl_version
    rules = field_rules(cfg, version)
    refused = refusal(config)
    if not refused and config.model.model_id != "toy":  # verl's peft would fail on the cluster
        from miniverl.models.loading import lora_targets_problem  # torch, transformers: only here

        refused = lora_targets_problem(config.model)
    if refused:
        raise MiniverlError(refused)
    folder = Path(folder).absolute()
    cwd = Path.cwd() if cwd is None else cwd
    reward = launch_reward(config, folder, cwd)
    overrides = verl_overrides(config, reward=reward, cwd=cwd)
    check_launch(overrides, version)
    warnings = differences(config)
    for path in next(o.value for o in overrides if o.key == "data.train_files"):
        if not os.path.exists(path):
            warnings.append(
                f"data file {path} does not exist here: the verl trainer must see it at this path "
                "(or set TRAIN_FILES in run_opd.sh)"
            )
    warnings += plain_string_prompts(config)
    if reward.written is None and not os.path.exists(reward.path):
        warnings.append(f"reward function file {reward.path} does not exist here: the verl trainer must see it there")
    digest = field_rule_digest(version=version)
    files = {
        "overrides.txt": "".join(o.line + "\n" for o in overrides),
        "run_opd.sh": launch_script(config, overrides, digest, reward),
        **({reward.written: reward.source} if reward.written else {}),
        "field_rules.json": json.dumps(rules_document(config, rules, overrides, digest), indent=2) + "\n",
        "README.md": readme(config, warnings, digest, reward),
    }
    unedited = written_unedited(folder)
    edited = edited_since_written(folder, files, unedited)
    if edited:
        raise MiniverlError(
            f"{folder} holds {', '.join(edited)} that miniverl did not write there (edited since, or not an export "
            "of miniverl's) and this export would replace: choose another hydra.run.dir, or move them away"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)
        (folder / "run_opd.sh").chmod(0o755)
        # Still listed: an earlier export's unedited files this one does not write (its other reward file).
        sums = {**unedited, **{name: sha256_file(folder / name) for name in files}}
        (folder / WRITTEN_SUMS).write_text("".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items())))
    except OSError as error:
        raise MiniverlError(f"cannot write the verl export into {folder}: {error.strerror}") from None
    return ExportResult(folder, overrides, warnings, digest)
