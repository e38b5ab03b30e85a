"""The files of a verl launch, as text: run_opd.sh in the shape of verl's example scripts, the
README of what does not carry over, field_rules.json, and the task reward verl's reward manager is
pointed at (launch_writer.py decides the overrides; this writes them down)."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from miniverl import __version__
from miniverl.config import MiniverlConfig
from miniverl.utils.tables import flatten
from miniverl.verl_compat.defaults import (
    ENTRY_POINT,
    FIXED,
    MODEL,
    TEACHER,
    TEACHERS,
)
from miniverl.verl_compat.field_rules import rule_table, rules_for
from miniverl.verl_compat.overrides import override_line
from miniverl.verl_compat.versions import release

NO_TASK_REWARD_FILE = "no_task_reward.py"  # estimator.use_task_rewards=false: 0 for every sample
TASK_REWARD_FILE = "task_reward.py"  # true, and no function of the user's: miniverl's rules, scored by verl
SECTIONS = ("DATA", "MODEL", "ACTOR", "ROLLOUT", "TRAINER", "DISTILLATION")


@dataclass
class Override:
    section: str
    key: str
    value: Any
    sources: tuple[str, ...]  # the miniverl field(s) it comes from; ("fixed",) for FIXED keys
    prefix: str = ""  # "+": a key verl's YAML does not have (inside a free-form dict)

    @property
    def line(self) -> str:
        return self.prefix + override_line(self.key, self.value)


def resolved_flat(config: MiniverlConfig) -> dict[str, Any]:
    return flatten(asdict(config))


def rules_document(config: MiniverlConfig, rules: list[dict], overrides: list[Override], digest: str) -> dict:
    values = resolved_flat(config)
    written: dict[str, list[str]] = {}
    for o in overrides:
        for source in o.sources:
            written.setdefault(source, []).append(o.line)
    table = rule_table(config.export.verl_version)
    return {
        "schema": "miniverl.verl_field_rules/v1",
        "field_rule_digest": digest,
        "verl": table["verl"],
        "rules": rules,
        "fixed": table["fixed"],
        "applied": [
            {"field": name, "value": values.get(name), "verl": written.get(name, [])} for name in sorted(values)
        ],
    }


NO_TASK_REWARD_SOURCE = '''"""Written by miniverl's export: the task reward of a pure on-policy distillation launch.

The launch sets distillation.distillation_loss.use_task_rewards=False, so verl trains on the
distillation loss only; verl's reward manager still scores every sample. This scorer returns 0 for
all of them, so that no scorer for the rows' data_source is needed.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 0.0
'''

TASK_REWARD_SOURCE = '''"""Written by miniverl's export: the task reward of a launch with task rewards, as miniverl
scores it.

miniverl's rules (miniverl/utils/reward_score/) score each row by its data_source as verl's
default_compute_score does; its toy source uses verl's GSM8K rule in its "flexible" mode (the last
number of the response). Both are verl's own functions here.
"""

from verl.utils.reward_score import default_compute_score, gsm8k


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if data_source == "miniverl/toy_arithmetic":
        return gsm8k.compute_score(solution_str, ground_truth, method="flexible")
    return default_compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
'''


@dataclass(frozen=True)
class LaunchReward:
    """The task reward verl's reward manager is pointed at: a file the export writes beside the
    launch (`written`, holding `source`), or the user's own function (`written` None)."""

    path: str
    name: str
    written: str | None = None
    source: str | None = None


def absolute_path(path: str, cwd: Path) -> str:
    """A config's path as the trainer must see it: relative paths are taken from `cwd`, ~ expanded."""
    return os.path.abspath(os.path.join(cwd, os.path.expanduser(path)))


def local_model_path(model_id: str | None, cwd: Path) -> str | None:
    """A model or tokenizer id as the launch must see it: a local folder (relative to `cwd`, ~ expanded)
    as its absolute path, so that run_opd.sh loads the same folder from any folder (relative, verl
    would look for it where the launch starts, or read it as a hub id); a hub id, toy or null as it is."""
    if not model_id or model_id == "toy":
        return model_id
    path = absolute_path(model_id, cwd)
    return path if os.path.isdir(path) else model_id


def launch_reward(config: MiniverlConfig, folder: Path, cwd: Path) -> LaunchReward:
    custom = config.reward.custom_reward_function
    if not config.estimator.use_task_rewards:
        return LaunchReward(
            str(folder / NO_TASK_REWARD_FILE), "compute_score", NO_TASK_REWARD_FILE, NO_TASK_REWARD_SOURCE
        )
    if custom.path:  # the user's own function, at the path the trainer must see
        return LaunchReward(absolute_path(custom.path, cwd), custom.name)
    return LaunchReward(str(folder / TASK_REWARD_FILE), "compute_score", TASK_REWARD_FILE, TASK_REWARD_SOURCE)


def _shell_word(text: str) -> str:
    return shlex.quote(text)


def teacher_variable(where: str) -> str:
    """run_opd.sh's variable for a teacher's model: TEACHER_MODEL, or TEACHER_<NAME>_MODEL for
    `teachers.<name>`."""
    if where == "teacher":
        return "TEACHER_MODEL"
    return "TEACHER_" + re.sub(r"[^A-Za-z0-9]", "_", where.removeprefix("teachers.")).upper() + "_MODEL"


def written_key(config: MiniverlConfig, key: str) -> str:
    """A FIXED key as the launch writes it: a teacher_model key once per teacher with several."""
    if config.teachers and key.startswith(f"{TEACHER}."):
        return f"{TEACHERS}.<name>.{key.removeprefix(TEACHER + '.')}"
    return key


def teacher_variables(config: MiniverlConfig) -> list[str]:
    return [teacher_variable(f"teachers.{name}") for name in config.teachers] or ["TEACHER_MODEL"]


def launch_script(config: MiniverlConfig, overrides: list[Override], digest: str, reward: LaunchReward) -> str:
    """run_opd.sh: the overrides as bash arrays, the user-adjustable model and data paths first."""
    x, r = config.export, config.recipe
    verl = release(x.verl_version)
    by_key = {o.key: o for o in overrides}
    teachers = {  # verl key of each teacher's model -> its shell variable
        (f"{TEACHERS}.{name}.model_path" if config.teachers else f"{TEACHER}.model_path"): teacher_variable(
            f"teachers.{name}" if config.teachers else "teacher"
        )
        for name in (config.teachers or ["teacher"])
    }
    variables = {  # verl key -> (shell variable, its default: the Hydra value the export wrote)
        f"{MODEL}.path": "STUDENT_MODEL",
        **teachers,
        "data.train_files": "TRAIN_FILES",
        "data.val_files": "VAL_FILES",
        **({"reward.custom_reward_function.path": None} if reward.written else {}),
    }
    engine = {"vllm": "vLLM", "sglang": "SGLang"}[x.rollout_name]
    lines = [
        "#!/usr/bin/env bash",
        f"# On-policy distillation | text | {engine} rollout + teacher | FSDP training | NVIDIA GPUs",
        f"# Exported by miniverl {__version__} from recipe {r.name} (profile {r.profile}) for verl {verl.tag}",
        f"# ({verl.source[:60]}), in the shape of examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh.",
        f"# Trainer pool: {x.nnodes} node(s) x {x.n_gpus_per_node} GPU(s) (actor + rollout, colocated); teacher pool: "
        f"{x.teacher_nnodes} node(s) x {x.teacher_n_gpus_per_node} GPU(s)",
        f"# ({len(config.teachers) or 1} teacher(s) x {x.teacher_replicas} replica(s) x tensor parallel "
        f"{x.teacher_tensor_parallel_size}). To change the scale, "
        "export again with export.* (python -m miniverl.export ...): verl checks these numbers together.",
        "# The same overrides, one per line: overrides.txt. What does not carry over from miniverl: README.md.",
        f"# Field rules: field_rules.json (field_rule_digest {digest}).",
        "",
        "set -euo pipefail",
        "",
        "# ---- user-adjustable ----",
        f"STUDENT_MODEL=${{STUDENT_MODEL:-{_shell_word(by_key[f'{MODEL}.path'].line.split('=', 1)[1])}}}",
        *(f"{name}=${{{name}:-{_shell_word(by_key[key].line.split('=', 1)[1])}}}" for key, name in teachers.items()),
        f"TRAIN_FILES=${{TRAIN_FILES:-{_shell_word(by_key['data.train_files'].line.split('=', 1)[1])}}}",
        "VAL_FILES=${VAL_FILES:-$TRAIN_FILES}"
        if by_key["data.val_files"].value == by_key["data.train_files"].value
        else f"VAL_FILES=${{VAL_FILES:-{_shell_word(by_key['data.val_files'].line.split('=', 1)[1])}}}",
        "# ---- end user-adjustable ----",
        "",
        'EXPORT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)',
        "",
        "if " + " || ".join(f'[ "${name}" = toy ]' for name in ["STUDENT_MODEL", *teachers.values()]) + "; then",
        f'    echo "run_opd.sh: the toy models have no verl equivalent; set STUDENT_MODEL and '
        f'{" and ".join(teachers.values())} to Hugging Face models (hub ids or folders) that share one tokenizer" >&2',
        "    exit 2",
        "fi",
        "",
        "set -x",
        "",
        "########################### parameter arrays ###########################",
    ]
    for section in SECTIONS:
        lines.append("")
        lines.append(f"{section}=(")
        for o in overrides:
            if o.section != section:
                continue
            if o.key in variables:
                name = variables[o.key]
                value = f'"$EXPORT_DIR/{reward.written}"' if name is None else f'"${name}"'
                lines.append(f"    {o.prefix}{o.key}={value}")
            else:
                lines.append(f"    {_shell_word(o.line)}")
        lines.append(")")
    lines += ["", "########################### launch ###########################", f"{ENTRY_POINT} \\"]
    lines += [f'    "${{{section}[@]}}" \\' for section in SECTIONS]
    lines += ['    "$@"', ""]
    return "\n".join(lines)


def _reward_sentence(reward: LaunchReward) -> str:
    if reward.written == NO_TASK_REWARD_FILE:
        return f"Task rewards are off: `{reward.written}` scores every sample 0."
    if reward.written == TASK_REWARD_FILE:
        return (
            f"Task rewards are on: `{reward.written}` scores each row by its `data_source` with verl's own "
            "scorers, as miniverl's rules do."
        )
    return f"Task rewards are on: `{reward.name}` of `{reward.path}` scores them (it must exist on the trainer)."


def readme(config: MiniverlConfig, warnings: list[str], digest: str, reward: LaunchReward) -> str:
    x, r = config.export, config.recipe
    verl = release(x.verl_version)
    trainer_gpus, teacher_gpus = x.nnodes * x.n_gpus_per_node, x.teacher_nnodes * x.teacher_n_gpus_per_node
    warned = {w.split("=", 1)[0] for w in warnings}
    out = [
        f"# verl {verl.tag} launch of the miniverl recipe `{r.name}`",
        "",
        f"Profile `{r.profile}`, exported by miniverl {__version__} for verl {verl.tag} ({verl.source}); field "
        f"rule digest `{digest}` (of verl {verl.version}'s rule table). miniverl's docs/verl-versions.md says what "
        "differs between verl 0.8.0 and 0.9.1.",
        "",
        "```bash",
        f"bash run_opd.sh        # STUDENT_MODEL=DIR {' '.join(f'{t}=DIR' for t in teacher_variables(config))} "
        "TRAIN_FILES='[/data/a.parquet]' bash run_opd.sh",
        "xargs -d '\\n' python3 -m verl.trainer.main_ppo < overrides.txt   # the same launch, without the script",
        "```",
        "",
        f'Run it where verl {verl.version} and {x.rollout_name} are installed (`pip install "{verl.requirement}" '
        f"{x.rollout_name}`), on a Ray cluster (or one machine) with "
        f"{trainer_gpus + teacher_gpus} GPUs: the trainer pool, {x.nnodes} x {x.n_gpus_per_node}, holds the FSDP "
        f"actor and its {x.rollout_name} rollout (tensor parallel {x.rollout_tensor_parallel_size}); the teacher "
        f"pool, {x.teacher_nnodes} x {x.teacher_n_gpus_per_node}, serves "
        + (f"the {len(config.teachers)} frozen teachers, each" if config.routed else "the frozen teacher")
        + f" ({x.teacher_replicas} replica(s), tensor parallel {x.teacher_tensor_parallel_size})"
        + (f", routed by `{config.teacher_key}`" if config.routed else "")
        + ". Change the scale by exporting again with "
        "`export.*`. The data files must be visible to the trainer at the `TRAIN_FILES` paths, and each row needs "
        "`data_source` and `reward_model.ground_truth` (verl's reward manager reads them even with task rewards "
        f"off). {_reward_sentence(reward)}",
        "",
        "`field_rules.json` holds every miniverl field's rule (the verl key it maps to, or why it has none) and what "
        "it wrote here.",
        "",
    ]
    if warnings:
        out += ["## Differences in this export", ""] + [f"- {w}" for w in warnings] + [""]
    out += ["## What does not carry over from miniverl", ""]
    unread = "teacher." if config.teachers else "teachers."  # the single teacher's rules, or several's
    for rule in rules_for(verl.version):
        if rule.field in warned or rule.field.startswith(unread):
            continue
        if rule.status == "no_verl_equivalent":
            out.append(f"- `{rule.field}`: {rule.note}.")
        elif rule.status == "fixed_in_verl":
            out.append(
                f"- `{rule.field}`: verl {verl.version} always uses `{rule.verl_value!r}` ({rule.note.split(';')[0]})."
            )
    out += [
        "- Exactness: verl's rollout engine does not seed each sample, so a verl run is neither byte-reproducible "
        "nor exactly resumable; its checkpoints are verl's, not miniverl's.",
        *(
            [
                f"- verl {verl.version} normalises the first micro-batch of each update with the previous update's "
                "token and row counts (the ordering behind verl #7200); miniverl uses the current mini-batch's "
                "for every chunk, as verl 0.9 does (miniverl's docs/verl-versions.md)."
            ]
            if verl.distillation_reads_previous_normalisers
            else []
        ),
        *(
            []
            if config.algorithm.rollout_correction.bypass_mode
            else [
                f"- verl {verl.version} recomputes the old log-probs in a pass of their own before each update; "
                "miniverl takes them from the update's own forward (on-policy, ratio exactly 1). They differ by "
                "rounding (docs/losses.md)."
            ]
        ),
        "",
        "Also written, because of what a miniverl recipe is: "
        + "; ".join(f"`{written_key(config, key)}`" for key, _, _ in FIXED)
        + ". Every other key takes verl's YAML default.",
        "",
    ]
    return "\n".join(out)
