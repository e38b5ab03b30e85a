"""DAPO's math rule (verl: reward_score/math_dapo.py; data sources math_dapo, math,
math_dapo_reasoning, aime*): +1 for a right answer, -1 otherwise (never 0).

Of the last 300 characters of a solution, the last `Answer: ...` line (any case), normalised as
Minerva normalises final answers, must equal the normalised ground truth. verl 0.9.1 falls back to
the last \\boxed{...} of the final 100 characters when there is no such line (compared with the
ground truth as written); verl 0.8.0 does not (`boxed_fallback=False`).
"""

from __future__ import annotations

import re

DAPO_TAIL_CHARS = 300  # verl: "the longest answer in MATH-500 has 159 characters"
DAPO_BOX_TAIL_CHARS = 100  # the \boxed{} fallback looks at this much of that tail
NO_ANSWER = "[INVALID]"  # the prediction of a solution without an `Answer:` line
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva's final-answer normalisation (Lewkowycz et al. 2022, appendix D.1), in its order.
_REPLACED = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)  # fmt: skip
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip
_UNWRAPPED = (  # (pattern, replacement), applied in order
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),  # the math between the first two $
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),  # \sqrt3 -> \sqrt{3}
)


def minerva_normalise(answer: str) -> str:
    """A final answer as Minerva compares it: the right side of its last `=`, units and TeX noise
    removed, shorthand fractions and roots braced, `$` dropped, `1,000` -> `1000`."""
    answer = answer.split("=")[-1]
    for old, new in _REPLACED:
        answer = answer.replace(old, new)
    for noise in _REMOVED:
        answer = answer.replace(noise, "")
    for pattern, replacement in _UNWRAPPED:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def last_boxed_strict(text: str) -> str | None:
    """The content of the last `\\boxed{` whose braces close, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{") : end]
    return None


def math_dapo_verdict(solution: str, ground_truth: str, boxed_fallback: bool = True) -> tuple[bool, str | None]:
    """(right?, the prediction compared) for a solution already cut to its tail."""
    lines = _ANSWER_LINE.findall(solution)
    prediction = minerva_normalise(lines[-1] if lines else NO_ANSWER)
    right = prediction == minerva_normalise(ground_truth)
    if not boxed_fallback or prediction != NO_ANSWER:
        return right, prediction
    boxed = last_boxed_strict(solution[-DAPO_BOX_TAIL_CHARS:])
    if boxed is not None:
        return boxed == ground_truth, boxed
    return right, prediction


def math_dapo_score(solution: str, ground_truth: str, boxed_fallback: bool = True) -> dict:
    """verl's result: {"score": 1.0 or -1.0, "acc": right?, "pred": the prediction compared}."""
    right, prediction = math_dapo_verdict(solution[-DAPO_TAIL_CHARS:], ground_truth, boxed_fallback)
    return {"score": 1.0 if right else -1.0, "acc": right, "pred": prediction}
