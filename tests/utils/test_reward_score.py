"""Rule rewards: miniverl's rules score verl's strings as verl v0.8.0's default_compute_score does
(golden scores made by verl's own functions); a user's own function loads from a file, with one
line for each way it can be wrong."""

from __future__ import annotations

import json
import re

import pytest

from miniverl.utils.errors import MiniverlError
from miniverl.utils.reward_score import RULES, default_compute_score, load_custom_reward_function, score_value

from conftest import DATA, ROOT

GOLDEN = json.loads((DATA / "verl-0.8.0-task-rewards.json").read_text())
SCORE_CASES = [c for c in GOLDEN["cases"] if c["kind"] == "reward_score"]


@pytest.mark.parametrize("case", SCORE_CASES, ids=lambda c: f"{c['data_source']}:{c['solution_str'][:20]}")
def test_rules_score_as_verl_does(case):
    got = default_compute_score(case["data_source"], case["solution_str"], case["ground_truth"])
    assert got == case["expected"]["score"]


def test_the_golden_strings_cover_every_rule_and_both_outcomes():
    sources = {c["data_source"] for c in SCORE_CASES}
    assert set(RULES) <= sources  # every rule is exercised
    assert {c["expected"]["score"] for c in SCORE_CASES} == {0.0, 1.0}


def test_a_users_function_is_loaded_from_its_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def score_it(data_source, solution_str, ground_truth, extra_info=None):\n    return {'score': .5}")
    fn = load_custom_reward_function(str(path), "score_it")
    assert score_value(fn(data_source="s", solution_str="text", ground_truth="1", extra_info=None)) == 0.5


@pytest.mark.parametrize(
    "source, name, message",
    [
        ("", "compute_score", "no such file"),
        ("def other(*a):\n    return 1\n", "compute_score", "defines no function 'compute_score' (it has: other)"),
        ("import not_a_module_anywhere\n", "compute_score", "failed to import: ModuleNotFoundError"),
    ],
)
def test_a_wrong_custom_function_is_one_line(tmp_path, source, name, message):
    path = tmp_path / "reward.py"
    if source:
        path.write_text(source)
    with pytest.raises(MiniverlError, match=re.escape(message)) as error:
        load_custom_reward_function(str(path), name)
    assert "\n" not in str(error.value)


def test_a_result_that_is_no_number_says_what_came_back():
    with pytest.raises(ValueError, match="returned 'yes': return a number or a dict with a 'score'"):
        score_value("yes")
    assert score_value({"score": 1, "extra": "kept for verl's reward_extra_info"}) == 1.0


def test_a_users_function_is_called_by_keyword_as_verl_calls_it_and_may_be_async(tmp_path):
    path = tmp_path / "keyword_reward.py"
    path.write_text(
        "async def compute_score(solution_str, ground_truth, data_source=None, extra_info=None, **kwargs):\n"
        "    return float(solution_str == ground_truth[0])  # the parameters in another order than verl's\n"
    )
    fn = load_custom_reward_function(str(path), "compute_score")
    assert fn(data_source="s", solution_str="7", ground_truth=["7", "seven"], extra_info=None) == 1.0


def test_an_import_error_names_the_line_of_the_users_file(tmp_path):
    path = tmp_path / "typo.py"
    path.write_text("import math\n\nx = undefined_name\n")
    with pytest.raises(MiniverlError, match=r"failed to import: NameError: .*undefined_name.* \(typo.py line 3\)"):
        load_custom_reward_function(str(path), "compute_score")


def test_the_shipped_example_reward_function_scores_exact_and_shaped_answers():
    fn = load_custom_reward_function(str(ROOT / "recipes/opd_k1_grpo_toy/digit_reward.py"), "compute_score")
    scores = [
        score_value(fn(data_source="miniverl/toy_arithmetic", solution_str=text, ground_truth="7", extra_info=None))
        for text in ("7", " 7\n", "17", "x")
    ]
    assert scores == [1.0, 1.0, 0.1, 0.0]
