"""OpenAI's PRM800K answer grader, in the two copies verl scores with: verl's own (prime_math, its
numina rule) and mathruler's (its geometry3k rule). An answer is right when

1. it equals the ground truth after the MATH normalisation ("mathd", hendrycks_math.py), or
2. after PRM800K's own normalisation (units, words, LaTeX rendered as text by pylatexenc), or
3. element by element (tuples and intervals), sympy simplifies their difference to 0 (not for
   unreduced fractions, nor when only one side is an integer).

The copies differ in small ways (`Grader`): mathruler removes bare `%` in step 1 and spaces and
braces in step 2, verl also strips "liter" as a unit. sympy runs in a helper process (sympy_check.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from miniverl.utils.reward_score.hendrycks_math import MATHRULER_PERCENT, VERL_PERCENT, normalise_math_answer
from miniverl.utils.reward_score.sympy_check import sympy_equal

UNITS = (
    "degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
    "foot", "feet", "inch", "yard",
)  # fmt: skip
TUPLE_CHARS = "()[]"
_TEXT_ONLY = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_PROPER_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")  # 1,000 (not the comma of a tuple)
_MIXED_NUMBER = re.compile(r"([0-9]) +([0-9])")  # 7 3/4 -> 7+3/4
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_TOO_HARD = ("^{", "^(")  # sympy may hang on these: not evaluated
_TOO_HARD_PATTERNS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_UNICODE_MATH = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))


@dataclass(frozen=True)
class Grader:
    """What differs between the copies of the grader."""

    name: str
    units: tuple[str, ...]
    percent: tuple[str, ...]  # what the MATH normalisation removes as a percent sign
    squeeze: bool  # remove spaces and braces after rendering the LaTeX


VERL_GRADER = Grader("verl prime_math", (*UNITS, "liter"), VERL_PERCENT, squeeze=False)
MATHRULER_GRADER = Grader("mathruler", UNITS, MATHRULER_PERCENT, squeeze=True)


@lru_cache(maxsize=2)
def _unit_patterns(units: tuple[str, ...]) -> tuple[re.Pattern, ...]:
    return tuple(re.compile(f"{unit}(es)?(s)? *(\\^[0-9]+)?") for unit in units)


def mathd_normalise(answer: str, grader: Grader) -> str:
    """Step 1: the MATH normalisation of the answer without an enclosing \\text{}; the answer so
    far where that normalisation fails."""
    answer = answer.strip()
    try:
        whole = _TEXT_ONLY.search(answer)
        if whole is not None:
            answer = whole.group("text").strip()
        return normalise_math_answer(answer, grader.percent)
    except (ValueError, IndexError):
        return answer


@lru_cache(maxsize=1)
def _latex_renderer():
    try:
        from pylatexenc import latex2text
    except ImportError as error:  # a declared dependency of miniverl: only a broken install lacks it
        raise ImportError("the numina and geometry3k rules need pylatexenc: pip install pylatexenc") from error
    return latex2text.LatexNodes2Text()


def latex_as_text(expr: str) -> str:
    """LaTeX rendered as plain text (pylatexenc), with the symbols sympy reads spelled out."""
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = _latex_renderer().latex_to_text(expr)
    for symbol, word in _UNICODE_MATH:
        expr = expr.replace(symbol, word)
    return expr.strip()


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_whole(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def strip_proper_commas(expr: str) -> str:
    while True:
        stripped = _PROPER_COMMA.sub(r"\1\3\4", expr)
        if stripped == expr:
            return stripped
        expr = stripped


def is_integer_text(text: str) -> bool:
    try:
        return _is_whole(float(strip_proper_commas(text)))
    except ValueError:
        return False


def prm800k_normalise(expr: str, grader: Grader) -> str:
    """Step 2: units, `%`, `$`, "million" and the like removed; LaTeX rendered as text; mixed
    numbers summed; lower case; integers written plainly."""
    whole = _TEXT_ONLY.search(expr)
    if whole is not None:
        expr = whole.group("text")
    for old, new in (
        ("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
        ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12"),
    ):  # fmt: skip
        expr = expr.replace(old, new)
    for unit in _unit_patterns(grader.units):
        expr = unit.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_float(expr) and _is_whole(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        try:
            expr = latex_as_text(expr)
        except ImportError:
            raise
        except Exception:  # pylatexenc could not read it: keep it as it is
            pass
    expr = re.sub("- *", "-", expr)
    expr = _MIXED_NUMBER.sub(r"\1+\2", expr)
    if grader.squeeze:
        expr = expr.replace(" ", "").replace("{", "").replace("}", "")
    expr = expr.lower()
    if is_integer_text(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def split_tuple(expr: str) -> list[str]:
    """The elements of `(a, b)` / `[a, b)` (no nested brackets), else [expr]; [] for ''."""
    expr = strip_proper_commas(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in TUPLE_CHARS and expr[-1] in TUPLE_CHARS:
        if not any(ch in expr[1:-1] for ch in TUPLE_CHARS):
            return [element.strip() for element in expr[1:-1].split(",")]
    return [expr]


def sympy_may_evaluate(expr: str) -> bool:
    """At most two distinct letters (sqrt and frac aside) and no towers of powers."""
    letters = {ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()}
    if len(letters) > 2 or any(bad in expr for bad in _TOO_HARD):
        return False
    return not any(pattern.search(expr) for pattern in _TOO_HARD_PATTERNS)


def equal_under_sympy(truth: str, given: str) -> bool:
    return sympy_may_evaluate(f"({truth})-({given})") and sympy_equal(truth, given)


def grade_answer(given: str | None, truth: str, grader: Grader = VERL_GRADER) -> bool:
    """PRM800K's verdict on `given` against the ground truth `truth` (the steps above)."""
    if given is None:
        return False
    if mathd_normalise(truth, grader) == mathd_normalise(given, grader):
        return True
    truth_n, given_n = prm800k_normalise(truth, grader), prm800k_normalise(given, grader)
    if truth_n == given_n:
        return True
    if not given_n:
        return False
    truth_elements, given_elements = split_tuple(truth_n), split_tuple(given_n)
    if len(truth_elements) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]):
        return False  # a tuple against another bracket
    if len(truth_elements) != len(given_elements):
        return False
    for t, g in zip(truth_elements, given_elements):
        if _FRACTION.search(t) and _FRACTION.search(g):
            right = t == g  # an unreduced fraction is not the reduced one
        elif is_integer_text(t) != is_integer_text(g):
            right = False  # an integer must match exactly
        else:
            right = equal_under_sympy(t, g)
        if not right:
            return False
    return True
