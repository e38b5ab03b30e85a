"""Geometry3K's rule (verl: reward_score/geo3k.py, data source hiyouga/geometry3k): 0.9 for the
right answer in the last \\boxed{} (mathruler's PRM800K grader, prm800k.py) + 0.1 for the format
`<think>...</think>...\\boxed{...}...`, so 0, 0.1, 0.9 or 1."""

from __future__ import annotations

import re

from miniverl.utils.reward_score.prm800k import MATHRULER_GRADER, grade_answer

GEO3K_FORMAT_WEIGHT = 0.1
_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def boxed_answer(text: str) -> str:
    """What the last `\\boxed{` encloses, stripped; "None" (a string, as mathruler returns it)
    when there is none or its brace does not close."""
    start = text.rfind("\\boxed{")
    if start == -1:
        return "None"
    content = text[start + len("\\boxed{") :]
    depth = 0
    for end, char in enumerate(content):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == -1:
            return content[:end].strip()
    return "None"


def geo3k_score(solution: str, ground_truth: str) -> float:
    right = 1.0 if grade_answer(boxed_answer(solution), ground_truth, MATHRULER_GRADER) else 0.0
    formatted = 1.0 if _FORMAT.fullmatch(solution) else 0.0
    return (1.0 - GEO3K_FORMAT_WEIGHT) * right + GEO3K_FORMAT_WEIGHT * formatted
