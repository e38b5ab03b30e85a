"""PRIME's math rule (verl: reward_score/prime_math; the numina_* data sources): 1 or 0.

The answer is taken from the response's end (after its last "answer:" / "answer is", its last
\\boxed{}, after its last "is" / "=" / ":"), then graded by the PRM800K grader (prm800k.py); when
that says no, by `math_equal`: numbers within 1e-4 (relative, also x100 and /100 for percents),
\\pi written as a number (and as 3.14), intervals, tuples, points and matrices element by element.

verl ends `math_equal` with a sympy comparison whose timeout guard fails to start in every
release read (verl 0.8.0 and 0.9.1 use a decorator as a context manager), so it never finds an
answer right: that last step is not here, and the scores are the same. Where verl calls eval() on
an answer, miniverl evaluates arithmetic only (safe_eval.py).
"""

from __future__ import annotations

import math
import re
from math import isclose

from miniverl.utils.reward_score.prm800k import VERL_GRADER, grade_answer
from miniverl.utils.reward_score.safe_eval import safe_eval
from miniverl.utils.reward_score.sympy_check import sympy_items

_LEADING_MARKERS = ("answer:", "answer is", "answers are")  # the answer follows the last of each
_TRAILING_MARKERS = ("is answer", "is the answer", "are answers", "are the answers")  # ... precedes it
_FINAL_MARKERS = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")
_DOLLARS = re.compile(r"\$\d+(\.\d+)?")
_PERCENTS = (re.compile(r"^\d+(\.\d+)?%$"), re.compile(r"^\d+(\.\d+)?\\%$"))
_INTERVALS = (  # sympy's printing of an interval -> its bracket notation
    (re.compile(r"^Interval\((.*)\)$"), "[{}]"),
    (re.compile(r"^Interval\.Ropen\((.*)\)$"), "[{})"),
    (re.compile(r"^Interval\.Lopen\((.*)\)$"), "({}]"),
    (re.compile(r"^Interval\.open\((.*)\)$"), "({})"),
)
PMATRIX = r"\begin{pmatrix}"


def _after_last(text: str, marker: str) -> str | None:
    """The text after the last `marker` (found case-blind), stripped; None when absent."""
    at = text.lower().rfind(marker)
    if at == -1:
        return None
    text = text[at + len(marker) :].strip()
    return text[:-2] if text.endswith("\n") else text


def boxed_content(text: str) -> str | None:
    """What the braces after the last \\boxed (or \\fbox) enclose, stripped; None without braces."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    opened = None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
            opened = i if opened is None else opened
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[opened + 1 : i].strip() if opened is not None else None
    return None


def match_answer(response: str) -> tuple[bool, str]:
    """(found an answer with a digit?, the answer) at the response's end."""
    matched = False
    for marker in _LEADING_MARKERS:
        after = _after_last(response, marker)
        if after is not None:
            matched, response = True, after
    for marker in _TRAILING_MARKERS:
        at = response.lower().rfind(marker)
        if at != -1:
            matched, response = True, response[:at].strip()
            response = response[:-2] if response.endswith("\n") else response
    boxed = boxed_content(response)
    if boxed:
        matched, response = True, boxed
    if ". " in response:
        at = response.lower().rfind(". ")
        if at != -1:
            response = response[:at].strip()
    for marker in _FINAL_MARKERS:
        after = _after_last(response, marker)
        if after is not None:
            matched, response = True, after
    return matched and any(c.isdigit() for c in response), response


def _number(value) -> tuple[bool, float | None]:
    """(is it a number?, its value) read from its text: `1,000` and `1{,}000` as 1000."""
    text = str(value)
    try:
        return True, float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return False, None


def _with_pi(text: str, pi: float) -> str:
    """Each \\pi written as `*<pi>` after a digit, else `1*<pi>`."""
    at = text.find("\\pi")
    while at != -1:
        text = text[:at] + (f"*{pi}" if at > 0 and text[at - 1].isdigit() else f"1*{pi}") + text[at + 3 :]
        at = text.find("\\pi", at + 1)
    return text


def normalise(answer, pi: float):
    """`$5` -> `5`, `5%` -> `5`; `10_2` (a base) -> 10; an answer with \\pi -> its value where it
    is arithmetic. A ValueError where a base's digits are no number."""
    if isinstance(answer, str) and _DOLLARS.match(answer):
        return answer[1:]
    if isinstance(answer, str) and any(p.match(answer) for p in _PERCENTS):
        return answer.replace("\\%", "").replace("%", "")
    if isinstance(answer, str) and "_" in answer:
        return int(float(answer.split("_")[0]))
    if isinstance(answer, str) and "\\pi" in answer:
        answer = _with_pi(answer, pi)
        try:
            answer = safe_eval(answer)
        except Exception:  # not arithmetic: stays text
            pass
    return answer


def _interval(text: str) -> str:
    for pattern, brackets in _INTERVALS:
        found = pattern.match(text)
        if found:
            return brackets.format(found.group(1))
    return text


def _all_equal(pairs, include_percentage: bool, tolerance: float) -> bool:
    """Every pair math_equal, each one compared (an error in any is an error), as the original."""
    return all([math_equal(p, r, include_percentage, tolerance) for p, r in pairs])


def math_equal(prediction, reference, include_percentage: bool = True, tolerance: float = 1e-4, pi=math.pi) -> bool:
    """Is `prediction` the `reference`? As text, as numbers, or part by part. May raise on odd
    input (the caller counts that as wrong)."""
    prediction, reference = normalise(prediction, pi), normalise(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    (p_is_number, p_value), (r_is_number, r_value) = _number(prediction), _number(reference)
    if p_is_number and r_is_number:
        candidates = [r_value / 100, r_value, r_value * 100] if include_percentage else [r_value]
        return any(isclose(c, p_value, rel_tol=tolerance) for c in candidates)
    if not prediction and prediction not in [0, False]:
        return False
    reference, prediction = str(reference).strip(), _interval(str(prediction).strip())

    p_bare, r_bare = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or (
        prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")
    ):
        p_bare, r_bare = p_bare.strip("[]()"), r_bare.strip("[]()")
    for bracket in "{}()":
        p_bare, r_bare = p_bare.replace(bracket, ""), r_bare.replace(bracket, "")
    if p_bare == r_bare:
        return True

    if (
        prediction
        and reference
        and prediction[0] in "(["
        and prediction[-1] in ")]"
        and (prediction[0], prediction[-1]) == (reference[0], reference[-1])
    ):  # [a, b] against [c, d]: a == c and b == d
        p_parts, r_parts = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(p_parts) == len(r_parts) and _all_equal(zip(p_parts, r_parts), include_percentage, tolerance):
            return True

    if "," in prediction and "," in reference:  # a, b against c, d
        p_parts = [part.strip() for part in prediction.split(",")]
        r_parts = [part.strip() for part in reference.split(",")]
        if len(p_parts) == len(r_parts):
            return _all_equal(zip(p_parts, r_parts), include_percentage, tolerance)

    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        p_parts = prediction[prediction.find("(") + 1 : -1].split(",")
        r_parts = reference[1:-1].split(",")
        if len(p_parts) == len(r_parts) and _all_equal(zip(p_parts, r_parts), include_percentage, tolerance):
            return True

    if PMATRIX in reference and prediction.startswith("Matrix"):  # sympy's Matrix against a pmatrix
        elements = sympy_items(prediction)
        r_parts = reference.split()[1:-1:2]
        try:
            if (
                elements is not None
                and len(elements) == len(r_parts)
                and _all_equal(zip(elements, r_parts), include_percentage, tolerance)
            ):
                return True
        except Exception:  # as the original: a failing element comparison is "not this way"
            pass
    elif PMATRIX in reference and prediction.startswith("[") and prediction.endswith("]"):
        if isinstance(safe_eval(prediction), list):  # errors propagate here, as eval()'s do
            try:
                rows = (
                    reference.removeprefix(r"\\begin{pmatrix}")
                    .removeprefix(PMATRIX)
                    .removesuffix(r"\\end{pmatrix}")
                    .removesuffix(r"\end{pmatrix}")
                    .split("\\")
                )
                r_parts = [row.split("&") if "&" in row else row for row in rows]
                matrix = safe_eval(prediction)
                if len(matrix) == len(r_parts) and _all_equal(zip(matrix, r_parts), include_percentage, tolerance):
                    return True
            except Exception:
                pass
    return False


def prime_math_verdict(solution: str, ground_truth: str) -> bool:
    """Is the answer at the end of `solution` the ground truth? (verl's `prime_math.compute_score`
    returns this, the format check and the answer; its default_compute_score keeps this.)"""
    solution, ground_truth = str(solution), str(ground_truth)
    _, answer = match_answer(solution)
    if grade_answer(answer, ground_truth, VERL_GRADER):
        return True
    try:
        if "\\pi" in answer or "\\pi" in ground_truth:
            verdicts = [math_equal(answer, ground_truth, pi=pi) for pi in (math.pi, 3.14)]
            return any(verdicts)
        return math_equal(answer, ground_truth)
    except Exception:  # an answer the comparisons cannot read is wrong
        return False


def prime_math_score(solution: str, ground_truth: str) -> float:
    return 1.0 if prime_math_verdict(solution, ground_truth) else 0.0
