"""Search-R1's exact-match rule (verl: reward_score/search_r1_like_qa_em.py; the searchR1_* data
sources): the last `<answer>...</answer>` of the response, normalised as SQuAD normalises
answers, equal to one of the ground truth's `target` answers: 1 (0.25 when the response holds
more than 10 `<answer>` or `</answer>` tags), else 0.

verl also prints one sample in 64, drawing from Python's global `random`; miniverl does neither.
"""

from __future__ import annotations

import re
import string

MAX_ANSWER_TAGS = 10  # more tags than this: a quarter of the score
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalise_qa_answer(text: str) -> str:
    """Lower case, ASCII punctuation and the articles a/an/the removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def tagged_answer(text: str) -> str | None:
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def exact_match(prediction: str, targets) -> bool:
    """`targets`: one answer, or several (a list, tuple or array of strings)."""
    targets = [targets] if isinstance(targets, str) else targets
    normalised = normalise_qa_answer(prediction)
    return any(normalise_qa_answer(target) == normalised for target in targets)


def search_qa_score(solution: str, ground_truth: dict) -> float:
    """`ground_truth`: {"target": <answer or answers>} (verl's Search-R1 data)."""
    answer = tagged_answer(solution)
    if answer is None:
        return 0.0
    if not exact_match(answer, ground_truth["target"]):
        return 0.0
    if solution.count("<answer>") > MAX_ANSWER_TAGS or solution.count("</answer>") > MAX_ANSWER_TAGS:
        return 1.0 / 4
    return 1.0
