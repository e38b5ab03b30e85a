"""GSM8K's rule (verl: reward_score/gsm8k.py): the final `#### <number>` of a solution, or its last
number ("flexible", miniverl's toy source), equal to the ground truth as a string."""

from __future__ import annotations

import re

GSM8K_TAIL_CHARS = 300  # as verl: the final answer is near the end, and a regex over a long text is slow
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


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
