"""Read a verl v0.8.0 launch back into miniverl overrides: `python -m miniverl.import_verl FILE [-o OUT]`.

FILE is a launch script in the shape of verl's examples (bash arrays of overrides, `${VAR:-default}`,
`$(( ... ))`, then `python3 -m verl.trainer.main_ppo ...`; it is read, never run) or an overrides
file (one Hydra override per line, like the export's overrides.txt). The result means what the verl
launch means: a key the launch leaves out takes verl's YAML default. It writes one miniverl override
per line for every field that maps (`miniverl.verl_compat.field_rules`), then, as comments, the verl overrides
with no miniverl field and the miniverl fields verl does not set. Apply it on top of a recipe:

    python -m miniverl.main +recipe=opd_k1 $(grep -v '^#' OUT)

export -> import -> export gives the same overrides on every mapped field.
"""

from __future__ import annotations

import ast
import operator
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miniverl.utils.errors import MiniverlError
from miniverl.verl_compat.defaults import ACTOR, FIXED, LOGGERS_TO_VERL, MODEL, ROLLOUT, TEACHER, VERL_DEFAULTS
from miniverl.verl_compat.field_rules import RULES
from miniverl.verl_compat.overrides import get, hydra_value, virtual_verl_config

ENTRY = re.compile(r"^verl\.trainer\.main_ppo\w*$")
# $(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd): the folder of the script itself.
_HERE = re.compile(r'cd\s+"?\$\(\s*dirname\s+"?\$\{?(BASH_SOURCE(\[0\])?|0)\}?"?\s*\)"?\s*&&\s*pwd(\s+-P)?')


# ---------------------------------------------------------------- reading a launch script


class _Shell:
    """Just enough of bash to read verl's launch scripts: assignments, arrays, quotes, parameter
    expansion (${V}, ${V:-word}, ${A[@]}), arithmetic $(( )), and the main_ppo command line."""

    def __init__(self, env: Mapping[str, str], script_dir: str | None = None):
        self.script_dir = script_dir
        self.vars: dict[str, str] = dict(env)
        self.arrays: dict[str, list[str]] = {}

    # -- words
    @staticmethod
    def _join(splice: str | list[str], current: list[str], out: list[str]) -> list[str]:
        """Append an expansion to the word being built; "${ARR[@]}" gives one word per element."""
        if not isinstance(splice, list):
            current.append(splice)
            return current
        if current:
            out.append("".join(current))
        out.extend(splice[:-1])
        return [splice[-1]] if splice else []

    def words(self, text: str) -> list[str]:
        out: list[str] = []
        i, n = 0, len(text)
        current: list[str] | None = None
        while i < n:
            c = text[i]
            if c in " \t\n":
                if current is not None:
                    out.append("".join(current))
                    current = None
                i += 1
                continue
            if c == "#" and current is None:
                while i < n and text[i] != "\n":
                    i += 1
                continue
            if current is None:
                current = []
            if c == "'":
                end = text.index("'", i + 1)
                current.append(text[i + 1 : end])
                i = end + 1
            elif c == '"':
                i += 1
                while text[i] != '"':
                    if text[i] == "\\" and text[i + 1] in '$"\\`':
                        current.append(text[i + 1])
                        i += 2
                    elif text[i] == "$":
                        splice, i = self._dollar(text, i, quoted=True)
                        current = self._join(splice, current, out)
                    else:
                        current.append(text[i])
                        i += 1
                i += 1
            elif c == "\\":
                current.append(text[i + 1] if i + 1 < n else "")
                i += 2
            elif c == "$":
                splice, i = self._dollar(text, i, quoted=False)
                current = self._join(splice, current, out)
            else:
                current.append(c)
                i += 1
        if current is not None:
            out.append("".join(current))
        return out

    def _dollar(self, text: str, i: int, quoted: bool) -> tuple[str | list[str], int]:
        if text.startswith("$((", i):
            end = _matching(text, i + 1)
            return str(self.arith(text[i + 3 : end - 1])), end + 1
        if text.startswith("$(", i):
            end = _matching(text, i + 1)
            if self.script_dir is not None and _HERE.fullmatch(text[i + 2 : end].strip()):
                return self.script_dir, end + 1  # the script's own folder
            return text[i : end + 1], end + 1  # another command substitution: kept as written (never run)
        if text.startswith("${", i):
            end = _matching(text, i + 1, "{", "}")
            body = text[i + 2 : end]
            array = re.fullmatch(r"(\w+)\[[@*]\]", body)
            if array:
                return list(self.arrays.get(array.group(1), [])), end + 1
            m = re.fullmatch(r"(\w+)(:?[-=+])(.*)", body, re.S)
            if m:
                name, op, word = m.groups()
                value = self.vars.get(name)
                unset = value is None or (op.startswith(":") and value == "")
                if op.endswith("+"):
                    return ("" if unset else self.word(word)), end + 1
                return (self.word(word) if unset else value), end + 1
            return self.vars.get(body, ""), end + 1
        m = re.compile(r"\$(\w+|[@*#?])").match(text, i)
        if m:
            name = m.group(1)
            if name in "@*":
                return [], m.end()
            return self.vars.get(name, ""), m.end()
        return "$", i + 1

    def word(self, text: str) -> str:
        return " ".join(self.words(text))

    def arith(self, expr: str) -> int:
        expr = re.sub(r"\$\{?(\w+)\}?", lambda m: self.vars.get(m.group(1), "0"), expr)
        expr = re.sub(r"[A-Za-z_]\w*", lambda m: self.vars.get(m.group(0), "0") or "0", expr)
        return _eval_int(ast.parse(expr.strip(), mode="eval").body)

    # -- statements
    def run(self, text: str) -> list[str] | None:
        """The main_ppo command line's overrides, or None if the script has none."""
        text = text.replace("\\\n", " ")
        lines = text.split("\n")
        found: list[str] | None = None
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            i += 1
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^(?:export\s+|local\s+|declare\s+(?:-\w+\s+)?)?([A-Za-z_]\w*)=\((.*)$", line)
            if m:  # NAME=( ... ) over one or more lines
                body = m.group(2)
                while not _closes_array(body) and i < len(lines):
                    body += "\n" + lines[i]
                    i += 1
                self.arrays[m.group(1)] = self.words(body[: body.rstrip().rindex(")")])
                continue
            m = re.match(r"^(?:export\s+|local\s+)?([A-Za-z_]\w*)=(.*)$", line)
            if m:
                words = self.words(m.group(2)) if m.group(2) else [""]
                self.vars[m.group(1)] = words[0] if words else ""
                continue
            words = self.words(line)
            for k, word in enumerate(words):
                if ENTRY.match(word) and k >= 1 and words[k - 1] == "-m":
                    found = (found or []) + [w for w in words[k + 1 :] if w]
                    break
        return found


def _closes_array(body: str) -> bool:
    depth, quote = 1, None
    for c in body:
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return True
    return False


def _matching(text: str, start: int, open_: str = "(", close: str = ")") -> int:
    depth = 0
    for j in range(start, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j
    raise MiniverlError(f"unbalanced {open_}{close} in the launch script near: {text[start : start + 40]!r}")


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.floordiv,
    ast.Mod: operator.mod,
}


def _eval_int(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_int(node.left), _eval_int(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_int(node.operand)
    raise MiniverlError("the launch script's arithmetic $(( )) uses more than + - * / %")


def read_overrides(path: str | Path, env: Mapping[str, str] | None = None) -> list[str]:
    """The verl overrides of a launch script or an overrides file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise MiniverlError(f"cannot read {path}: {error.strerror}") from None
    if path.suffix == ".sh" or text.startswith("#!") or "verl.trainer.main_ppo" in text:
        found = _Shell(os.environ if env is None else env, str(path.resolve().parent)).run(text)
        if found is None:
            raise MiniverlError(f"{path}: no `python3 -m verl.trainer.main_ppo` command line found")
        return found
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


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


def to_miniverl(lines: list[str]) -> tuple[list[tuple[str, Any]], list[tuple[str, str]]]:
    """(miniverl overrides [(field, value)], verl overrides with no miniverl field [(line, why)])."""
    values, other = parse(lines)
    unmapped: list[tuple[str, str]] = [
        (
            line,
            "not a plain key=value override (a config-group choice, a deletion, "
            "a sweep, or a shell command left unrun)",
        )
        for line in other
    ]
    known = {key for key in values if key in VERL_DEFAULTS or _dict_parent(key) is not None}
    cfg = virtual_verl_config({k: v for k, v in values.items() if k in known})
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
    teachers = sorted({k.split(".")[2] for k in values if k.startswith("distillation.teacher_models.")})
    if any(name != "teacher_model" for name in teachers):
        raise MiniverlError(
            f"this verl launch configures teachers {', '.join(teachers)}: miniverl distils from one "
            "teacher (distillation.teacher_models.teacher_model)"
        )
    if v(f"{TEACHER}.model_path") is None:
        raise MiniverlError(f"this verl launch sets no {TEACHER}.model_path: there is no teacher to import")
    emit("estimator", v("distillation.distillation_loss.loss_mode"))  # the group; its fields follow
    identity_rules = [
        r
        for r in RULES
        if r.status == "mapped" and r.transform in ("identity", "list of module names", "absolute path")
    ]
    special = {
        "model.lora.r",
        "model.lora.target_modules",
        "trainer.logger",
        "actor.optim.eps",
        "data.train_files",
        "data.seed",
        "hardware.update_chunk",
        "recipe.optimizer_updates",
        "teacher.mode",
        "export.ppo_micro_batch_size_per_gpu",
        "export.log_prob_micro_batch_size_per_gpu",
        "export.max_token_len_per_gpu",
        "export.teacher_replicas",
    }
    for rule in identity_rules:
        if rule.field in special:
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
    # verl fills a single teacher's pool with as many replicas as fit (DistillationConfig).
    inference = f"{TEACHER}.inference"
    per_replica = v(f"{inference}.tensor_model_parallel_size") * v(f"{inference}.data_parallel_size")
    emit(
        "export.teacher_replicas",
        v("distillation.nnodes") * v("distillation.n_gpus_per_node") // per_replica,
        f"{TEACHER}.num_replicas",
    )
    for rule in RULES:
        if rule.status == "fixed_in_verl":
            emit(rule.field, rule.verl_value)
    same_base = v(f"{TEACHER}.model_path") == v(f"{MODEL}.path")  # the student's base as teacher: ref
    emit("teacher.mode", "ref" if same_base else "standard", "distillation.enabled")
    emit("recipe.prompt_limit", v("data.max_prompt_length"), "data.max_prompt_length")
    emit("recipe.response_limit", v("data.max_response_length"), "data.max_response_length")
    # LoRA: miniverl trains LoRA adapters only.
    rank, targets = v(f"{MODEL}.lora_rank"), v(f"{MODEL}.target_modules")
    if rank and rank > 0:
        emit("model.lora.r", rank, f"{MODEL}.lora_rank")
    else:
        skip(f"{MODEL}.lora_rank", "full fine-tuning: miniverl trains LoRA adapters only")
        if f"{MODEL}.lora_rank" not in values:
            unmapped.append(
                (f"{MODEL}.lora_rank=0 (verl's default)", "full fine-tuning: miniverl trains LoRA adapters only")
            )
    if isinstance(targets, list):
        emit("model.lora.target_modules", list(targets), f"{MODEL}.target_modules")
    else:
        skip(f"{MODEL}.target_modules", f"{targets!r}: miniverl takes a list of module names")
    # Loggers: console, file (jsonl), tensorboard.
    back = {verl: ours for ours, verl in LOGGERS_TO_VERL.items()}
    loggers = v("trainer.logger")
    loggers = [loggers] if isinstance(loggers, str) else list(loggers or [])
    emit("trainer.logger", [back[name] for name in loggers if name in back], "trainer.logger")
    for name in loggers:
        if name not in back:
            unmapped.append((f"trainer.logger: {name}", "miniverl logs to console, jsonl and tensorboard only"))
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
    if v("data.seed") is None:
        skip("data.seed", "null (an unseeded shuffle): miniverl's data.seed is a number")
    else:
        emit("data.seed", v("data.seed"), "data.seed")
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
    for key in (f"{ROLLOUT}.max_model_len", f"{TEACHER}.inference.max_model_len"):
        used.add(key)
    # The keys the export writes because of what the recipe is.
    for key, value, why in FIXED:
        used.add(key)
        if key in values and key != "reward.custom_reward_function.path" and values[key] != value:
            unmapped.append((f"{key}={hydra_value(values[key])}", f"miniverl means {hydra_value(value)}: {why}"))
    for key, value in values.items():
        if key not in used and _dict_parent(key) not in used:
            unmapped.append((f"{key}={hydra_value(value)}", "no miniverl field"))
    # One line per field (the last value wins), the estimator group first, then in the rules' order.
    final = dict(out)
    order = {"estimator": -1, **{rule.field: k for k, rule in enumerate(RULES)}}
    return sorted(final.items(), key=lambda item: order.get(item[0], len(order))), unmapped


def _dict_parent(key: str) -> str | None:
    """The free-form dict key of verl's defaults that `key` lies under (data.apply_chat_template_kwargs)."""
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:end])
        if isinstance(VERL_DEFAULTS.get(parent), dict):
            return parent
    return None


def override_lines(mapped: list[tuple[str, Any]]) -> list[str]:
    """miniverl override lines; a non-empty free-form dict field is written key by key (`++`, since
    Hydra refuses to merge new keys into a dict node of the config)."""
    lines = []
    for name, value in mapped:
        if isinstance(value, dict) and value and name == "data.apply_chat_template_kwargs":
            lines += [f"++{name}.{k}={hydra_value(v)}" for k, v in value.items()]
        else:
            lines.append(f"{name}={hydra_value(value)}")
    return lines


def unset_fields(mapped: list[tuple[str, Any]]) -> list[str]:
    """miniverl fields a verl launch does not set (kept from the config the import is applied to)."""
    names = {name for name, _ in mapped}
    out: list[str] = []
    for rule in RULES:
        if rule.field in names or rule.status not in ("no_verl_equivalent", "not_applicable"):
            continue
        name = re.sub(r"\.toy\..*$", ".toy.*", rule.field)
        if name not in out:
            out.append(name)
    return out


def render(source: str, mapped: list[tuple[str, Any]], unmapped: list[tuple[str, str]]) -> str:
    lines = [
        f"# miniverl overrides read from {source} (verl v0.8.0: a key the launch leaves out takes verl's default)",
        "# use: python -m miniverl.main +recipe=opd_k1 $(grep -v '^#' THIS_FILE)",
    ]
    lines += override_lines(mapped)
    lines.append("# verl overrides with no miniverl field (not imported):")
    lines += [f"#   {line}  -- {why}" for line, why in unmapped] or ["#   (none)"]
    lines.append(
        "# miniverl fields verl does not set (kept from the config you apply this to): "
        + ", ".join(unset_fields(mapped))
    )
    return "\n".join(lines) + "\n"


def import_file(path: str | Path, env: Mapping[str, str] | None = None) -> str:
    mapped, unmapped = to_miniverl(read_overrides(path, env))
    return render(str(path), mapped, unmapped)
