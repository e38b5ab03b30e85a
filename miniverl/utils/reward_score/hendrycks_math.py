"""The MATH benchmark's rule (Hendrycks et al.; verl: reward_score/math_reward.py): the last
\\boxed{...} of a solution equals the ground truth after the MATH answer normalisation.

The normalisation (`normalise_math_answer`) is also the first, "mathd" comparison of the PRM800K
grader that verl's numina and geometry3k rules use (prm800k.py), with its percent handling as a
parameter: verl's copy of it and mathruler's remove different percent spellings.
"""

from __future__ import annotations

import re

# What the MATH normalisation removes as a percent sign: verl's copies (math_reward, prime_math);
# mathruler's copy (geometry3k) removes `\%` and then any bare `%`.
VERL_PERCENT = ("\\\\%", "\\%")
MATHRULER_PERCENT = ("\\%", "%")


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
    """\\frac12 -> \\frac{1}{2}, \\frac1{2} -> \\frac{1}{2}; a \\frac with one character after it
    leaves the text as it was, one with nothing after it is an IndexError (as the original)."""
    head, *parts = text.split("\\frac")
    out = [head]
    for part in parts:
        if part[0] == "{":  # IndexError on a trailing \frac
            out.append("\\frac" + part)
        elif len(part) < 2:
            return text
        elif part[1] == "{":
            out.append("\\frac{" + part[0] + "}" + part[1:])
        else:
            out.append("\\frac{" + part[0] + "}{" + part[1] + "}" + part[2:])
    return "".join(out)


def _braced_sqrt(text: str) -> str:
    """\\sqrt3 -> \\sqrt{3}; a trailing \\sqrt is an IndexError (as the original)."""
    head, *parts = text.split("\\sqrt")
    return head + "".join("\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:]) for p in parts)


def _slash_fraction(text: str) -> str:
    """3/4 -> \\frac{3}{4} when both sides are plain integers."""
    parts = text.split("/")
    if len(parts) == 2 and all(re.fullmatch(r"-?\d+", p) for p in parts) and text == f"{int(parts[0])}/{int(parts[1])}":
        return f"\\frac{{{int(parts[0])}}}{{{int(parts[1])}}}"
    return text


def normalise_math_answer(text: str, percent: tuple[str, ...] = VERL_PERCENT) -> str:
    """The MATH benchmark's answer normalisation: layout and unit noise removed, fractions and
    roots braced, `x = 5` -> `5`, 0.5 -> \\frac{1}{2}. A ValueError (two units) or IndexError (a
    \\frac or \\sqrt with nothing after it) where the original normalisation fails."""
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
    for sign in percent:
        text = text.replace(sign, "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text.startswith("."):
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # `x = 5`, `k=3`
        text = sides[1]
    if "\\sqrt" in text:
        text = _braced_sqrt(text)
    text = _braced_fracs(text.replace(" ", ""))
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
