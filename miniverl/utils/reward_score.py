"""Rule rewards for task rewards: a score per sample from its decoded response and its row's
`reward_model.ground_truth`, chosen by the row's `data_source` as verl's `default_compute_score`
chooses (verl/utils/reward_score), or the user's own function.

    GSM8K     openai/gsm8k                 the last `#### <number>` equals the ground truth: 1, else 0
    MATH      lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500
                                           the last \\boxed{...} equals the ground truth after the
                                           MATH normalisation (Hendrycks et al.): 1, else 0
    toy       miniverl/toy_arithmetic      GSM8K's "flexible" rule: the last number of the response

The rules are miniverl's own code; tests/data/verl-0.8.0-task-rewards.json holds verl's scores of
the same strings (`python -m miniverl.conformance` checks them). verl's other sources (math_dapo,
prime_math, code sandboxes, search) have no rule here: name your own function for them
(`reward.custom_reward_function.path`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miniverl.utils.errors import MiniverlError

ScoreFn = Callable[..., Any]  # (data_source, solution_str, ground_truth, extra_info) -> float | {"score": ...}

GSM8K_TAIL_CHARS = 300  # as verl: the final answer is near the end, and a regex over a long text is slow
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


# ---------------------------------------------------------------------- GSM8K
def gsm8k_answer(solution: str, method: str = "strict") -> str | None:
    """The final answer of a GSM8K-style solution: strict, the last `#### <number>` (commas and $
    dropped); flexible, the last number that is more than a lone dot."""
    tail = solution[-GSM8K_TAIL_CHARS:]
    if method == "strict":
        found = _GSM8K_STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    if method == "flexible":
        numbers = [n for n in _NUMBER.findall(tail) if n not in ("", ".")]
        return numbers[-1] if numbers else None
    raise ValueError(f"gsm8k method {method!r}: strict or flexible")


def gsm8k_score(solution: str, ground_truth: str, method: str = "strict") -> float:
    answer = gsm8k_answer(solution, method)
    return 1.0 if answer is not None and answer == ground_truth else 0.0


# ---------------------------------------------------------------------- MATH (\boxed{})
def last_boxed(solution: str) -> str | None:
    """The content of the last \\boxed{...} (braces matched), or of a trailing `\\boxed x`;
    \\fbox{...} when there is no \\boxed."""
    if "\\boxed " in solution:  # `\boxed 5` (no braces): up to the next $
        return solution.split("\\boxed ")[-1].split("$")[0]
    start = solution.rfind("\\boxed")
    if start < 0:
        start = solution.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for end in range(start, len(solution)):
        depth += {"{": 1, "}": -1}.get(solution[end], 0)
        if solution[end] == "}" and depth == 0:
            whole = solution[start : end + 1]
            return whole[whole.index("{") + 1 : -1] if whole.startswith("\\boxed{") else None
    return None


def _braced_fracs(text: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{2} -> \\frac{1}{2}."""
    head, *parts = text.split("\\frac")
    out = [head]
    for part in parts:
        if part.startswith("{"):
            out.append("\\frac" + part)
        elif len(part) < 2:
            return text
        elif part[1] == "{":
            out.append("\\frac{" + part[0] + "}" + part[1:])
        else:
            out.append("\\frac{" + part[0] + "}{" + part[1] + "}" + part[2:])
    return "".join(out)


def _braced_sqrt(text: str) -> str:
    """\\sqrt3 -> \\sqrt{3}."""
    head, *parts = text.split("\\sqrt")
    return head + "".join("\\sqrt" + (p if p.startswith("{") else "{" + p[:1] + "}" + p[1:]) for p in parts)


def _slash_fraction(text: str) -> str:
    """3/4 -> \\frac{3}{4} when both sides are plain integers."""
    parts = text.split("/")
    if len(parts) == 2 and all(re.fullmatch(r"-?\d+", p) for p in parts) and text == f"{int(parts[0])}/{int(parts[1])}":
        return f"\\frac{{{int(parts[0])}}}{{{int(parts[1])}}}"
    return text


def normalise_math_answer(text: str) -> str:
    """The MATH benchmark's answer normalisation: layout and unit noise removed, fractions and
    roots braced, `x = 5` -> `5`, 0.5 -> \\frac{1}{2}."""
    for old, new in (
        ("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
        ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""),
    ):  # fmt: skip
        text = text.replace(old, new)
    if "\\text{ " in text:  # a unit after the number
        pieces = text.split("\\text{ ")
        if len(pieces) != 2:
            raise ValueError("more than one unit")
        text = pieces[0]
    text = text.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text.startswith("."):
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # `x = 5`, `k=3`
        text = sides[1]
    text = _braced_fracs(_braced_sqrt(text).replace(" ", ""))
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_fraction(text)


def math_equivalent(answer: str, ground_truth: str) -> bool:
    try:
        return normalise_math_answer(answer) == normalise_math_answer(ground_truth)
    except (ValueError, IndexError):  # a normalisation that does not apply: compare as written
        return answer == ground_truth


def math_score(solution: str, ground_truth: str) -> float:
    answer = last_boxed(solution)
    return 1.0 if answer is not None and math_equivalent(answer, ground_truth) else 0.0


# ---------------------------------------------------------------------- dispatch
RULES: dict[str, ScoreFn] = {
    "openai/gsm8k": lambda solution, truth: gsm8k_score(solution, truth, "strict"),
    **{
        source: math_score
        for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
    },
    "miniverl/toy_arithmetic": lambda solution, truth: gsm8k_score(solution, truth, "flexible"),
}


def default_compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None, **kwargs) -> float:
    """The rule of `data_source` (verl's signature, called by keyword); an unknown source is a KeyError."""
    return RULES[data_source](solution_str, ground_truth)


def where_in(error: BaseException, file: Path) -> str:
    """`<file> line <n>`: the deepest frame of `error` in the user's `file` ('' when none is)."""
    if isinstance(error, SyntaxError) and error.lineno is not None:
        return f" ({file.name} line {error.lineno})"
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if Path(f.filename) == file.resolve()]
    return f" ({file.name} line {lines[-1]})" if lines else ""


def load_custom_reward_function(path: str, name: str) -> ScoreFn:
    """`name` from the Python file `path` (verl: reward.custom_reward_function), called by keyword as
    verl calls it (an `async def` is run to completion); or one line saying what is wrong."""
    where = "reward.custom_reward_function"
    file = Path(path)
    if not file.is_file():
        relative = "" if file.is_absolute() else f" (paths are relative to {Path.cwd()})"
        raise MiniverlError(f"{where}.path={path}: no such file{relative}")
    spec = importlib.util.spec_from_file_location(f"miniverl_custom_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the user's file: where it failed, in one line (the chain for HYDRA_FULL_ERROR)
        raise MiniverlError(
            f"{where}.path={path} failed to import: {type(error).__name__}: {error}{where_in(error, file)}"
        ) from error
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise MiniverlError(
            f"{where}.name={name}: {path} defines no function {name!r} (it has: {', '.join(found) or 'none'})"
        )
    if inspect.iscoroutinefunction(fn):
        return lambda **kwargs: asyncio.run(fn(**kwargs))
    return fn


def score_value(result: Any) -> float:
    """A scorer's result as a float: a number, or a dict's "score" (verl's reward manager); a
    ValueError saying what came back otherwise."""
    value = result.get("score") if isinstance(result, dict) else result
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"returned {result!r:.80}: return a number or a dict with a 'score'") from None
