"""Rule rewards for task rewards: a score per sample from its decoded response and its row's
`reward_model.ground_truth`, chosen by the row's `data_source` as verl's `default_compute_score`
chooses (verl/utils/reward_score/__init__.py), or the user's own function (custom.py).

    data_source                                 rule (module)                                   scores
    openai/gsm8k                                the last `#### <number>` (gsm8k)                 0 / 1
    lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500
                                                the last \\boxed{}, MATH-normalised (hendrycks_math)  0 / 1
    math_dapo, math, math_dapo_reasoning, aime* the last `Answer:` line, Minerva-normalised;
                                                else the last \\boxed{} (math_dapo)              -1 / 1
    numina_aops_forum, numina_synthetic_math, numina_amc_aime, numina_synthetic_amc, numina_cn_k12,
    numina_olympiads                            PRIME's answer matcher + PRM800K grader (prime_math)  0 / 1
    hiyouga/geometry3k                          PRM800K grader (mathruler) on the last \\boxed{},
                                                + 0.1 for <think>...</think> (geo3k)        0 / 0.1 / 0.9 / 1
    searchR1_nq, searchR1_triviaqa, searchR1_popqa, searchR1_hotpotqa, searchR1_2wikimultihopqa,
    searchR1_musique, searchR1_bamboogle        exact match of the last <answer></answer> (search_qa)  0 / 0.25 / 1
    miniverl/toy_arithmetic                     GSM8K's "flexible" rule: the last number         0 / 1

The rules are miniverl's own code; tests/data/verl-0.8.0-task-rewards.json and
tests/data/verl-0.9.1-reward-rules.json hold verl's scores of the same strings (`python -m
miniverl.conformance FILE` checks them). verl's code sources (codecontests, apps, codeforces, taco)
run the response's code in a sandbox: no rule here; name your own function for them
(`reward.custom_reward_function.path`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miniverl.utils.reward_score.custom import (
    ScoreFn,
    load_custom_reward_function,
    reward_extra_info,
    score_value,
    where_in,
)
from miniverl.utils.reward_score.geo3k import geo3k_score
from miniverl.utils.reward_score.gsm8k import GSM8K_TAIL_CHARS, gsm8k_answer, gsm8k_score
from miniverl.utils.reward_score.hendrycks_math import last_boxed, math_equivalent, math_score, normalise_math_answer
from miniverl.utils.reward_score.math_dapo import math_dapo_score
from miniverl.utils.reward_score.prime_math import prime_math_score
from miniverl.utils.reward_score.search_qa import search_qa_score

__all__ = [
    "GSM8K_TAIL_CHARS",
    "NOT_COVERED",
    "RULES",
    "RULE_PREFIXES",
    "Rule",
    "ScoreFn",
    "default_compute_score",
    "gsm8k_answer",
    "gsm8k_score",
    "last_boxed",
    "load_custom_reward_function",
    "math_equivalent",
    "math_score",
    "normalise_math_answer",
    "reward_extra_info",
    "rule_for",
    "rule_names",
    "score_value",
    "where_in",
]


@dataclass(frozen=True)
class Rule:
    """A rule of verl's default_compute_score: `rule(solution, ground_truth) -> float`."""

    family: str  # verl's module: gsm8k, math_reward, math_dapo, prime_math, geo3k, search_r1_like_qa_em
    score: Callable[[str, Any], float]
    # What the row's reward_model.ground_truth must be: "text", a string (the rule compares strings);
    # "any", anything (the rule compares its str()); "targets", {"target": <answer or list of answers>}.
    truth: str = "text"

    def __call__(self, solution: str, ground_truth: Any) -> float:
        return self.score(solution, ground_truth)


def _group(names: str, rule: Rule) -> dict[str, Rule]:
    return dict.fromkeys(names.split(), rule)


_DAPO = Rule("math_dapo", lambda solution, truth: math_dapo_score(solution, truth)["score"])
_MATH = Rule("math_reward", math_score)
RULES: dict[str, Rule] = {
    "openai/gsm8k": Rule("gsm8k", lambda solution, truth: gsm8k_score(solution, truth, "strict")),
    **_group("lighteval/MATH DigitalLearningGmbH/MATH-lighteval HuggingFaceH4/MATH-500", _MATH),
    **_group("math_dapo math math_dapo_reasoning", _DAPO),
    **_group(
        "numina_aops_forum numina_synthetic_math numina_amc_aime numina_synthetic_amc numina_cn_k12 numina_olympiads",
        Rule("prime_math", prime_math_score, truth="any"),
    ),
    "hiyouga/geometry3k": Rule("geo3k", geo3k_score),
    **_group(
        "searchR1_nq searchR1_triviaqa searchR1_popqa searchR1_hotpotqa searchR1_2wikimultihopqa searchR1_musique "
        "searchR1_bamboogle",
        Rule("search_r1_like_qa_em", search_qa_score, truth="targets"),
    ),
    "miniverl/toy_arithmetic": Rule("gsm8k", lambda solution, truth: gsm8k_score(solution, truth, "flexible")),
}
RULE_PREFIXES: dict[str, Rule] = {"aime": _DAPO}  # every data_source starting with "aime" (aime24, aime2025, ...)
# verl's sources that miniverl does not score, and why.
NOT_COVERED: dict[str, str] = dict.fromkeys(
    ("codecontests", "apps", "codeforces", "taco"),
    "verl scores it by running the response's code (sandbox_fusion, or prime_code in a local process), "
    "which miniverl does not do",
)


def rule_for(data_source: str | None) -> Rule | None:
    """The rule verl's default_compute_score applies to `data_source`, or None."""
    if data_source is None:
        return None
    if data_source in RULES:
        return RULES[data_source]
    return next((rule for prefix, rule in RULE_PREFIXES.items() if data_source.startswith(prefix)), None)


def rule_names() -> str:
    """The data sources with a rule, for messages: `openai/gsm8k, ..., aime*`."""
    return ", ".join([*RULES, *(f"{prefix}*" for prefix in RULE_PREFIXES)])


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info=None, **kwargs) -> float:
    """The rule of `data_source` (verl's signature, called by keyword), as a float: verl returns
    math_dapo's {"score", "acc", "pred"} dict whole, miniverl its score. A source without a rule is
    a NotImplementedError, as in verl."""
    rule = rule_for(data_source)
    if rule is None:
        why = NOT_COVERED.get(data_source, "miniverl has no rule for it")
        raise NotImplementedError(f"no task-reward rule for data_source {data_source!r}: {why} (rules: {rule_names()})")
    return float(rule(solution_str, ground_truth))
