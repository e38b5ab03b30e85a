"""The reward role: each response decoded without its special tokens is scored against its row's
ground truth, the score placed at the sample's last response token; a failing function of the
user's is one line naming the row."""

from __future__ import annotations

import json

import pytest
import torch

from miniverl.config.reward import RewardConfig
from miniverl.models.toy import build_toy_tokenizer
from miniverl.protocol import Batch
from miniverl.utils.dataset import PromptSet, TaskRow
from miniverl.utils.errors import MiniverlError
from miniverl.workers.reward import RewardFailed, RewardWorker

TOKENIZER = build_toy_tokenizer()


def prompts_of(truths: list[str], source: str = "openai/gsm8k") -> PromptSet:
    rows = list(range(len(truths)))
    tasks = {r: TaskRow(source, t, {"index": r}) for r, t in zip(rows, truths)}
    return PromptSet([[1]] * len(rows), rows, [[]] * len(rows), truths, "sha", len(rows), tasks=tasks)


def batch_of(texts: list[str], rows: list[int]) -> Batch:
    end = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
    ids = [TOKENIZER(t, add_special_tokens=False)["input_ids"] + [end] for t in texts]
    width = max(map(len, ids)) + 2  # padding after the EOS
    responses = torch.full((len(ids), width), TOKENIZER.pad_token_id)
    mask = torch.zeros(len(ids), width)
    for i, seq in enumerate(ids):
        responses[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    empty = torch.zeros(len(ids), 1, dtype=torch.long)
    return Batch(torch.tensor(rows), empty, responses, empty, empty, empty, mask, mask)


def test_each_score_is_at_the_last_response_token_of_its_sample():
    worker = RewardWorker(TOKENIZER, prompts_of(["7", "12"]), RewardConfig())
    batch = worker.compute_reward(batch_of(["so #### 7", "#### 13", "#### 12"], [0, 1, 1]))
    scores = batch.token_level_scores
    assert scores.sum(-1).tolist() == [1.0, 0.0, 1.0]
    last = batch.response_mask.sum(-1).long() - 1  # the EOS: decoded as nothing, still the last token
    assert scores[0, last[0]] == 1.0 and scores[2, last[2]] == 1.0
    assert scores.count_nonzero() == 2


def test_a_failing_function_of_the_users_is_one_line_naming_the_row(tmp_path):
    fn = tmp_path / "broken.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1 / 0\n")
    reward = RewardConfig()
    reward.custom_reward_function.path = str(fn)
    worker = RewardWorker(TOKENIZER, prompts_of(["7", "12"], source="my/task"), reward)
    with pytest.raises(
        RewardFailed, match=r"ZeroDivisionError: division by zero \(broken.py line 2\) on row 1 "
    ) as error:
        worker.compute_reward(batch_of(["x"], [1]))
    assert "\n" not in str(error.value) and f"compute_score of {fn}" in str(error.value)
    assert isinstance(error.value.__cause__, ZeroDivisionError)  # the chain HYDRA_FULL_ERROR=1 shows


def test_a_ground_truth_that_is_no_string_is_refused_for_the_rules():
    with pytest.raises(MiniverlError, match=r"row 1: reward_model.ground_truth is 12 \(int\); .* compares strings"):
        RewardWorker(TOKENIZER, prompts_of(["7", 12]), RewardConfig())


def test_the_users_function_sees_the_rows_extra_info(tmp_path):
    fn = tmp_path / "extra.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return float(extra_info['index'])\n")  # fmt: skip
    reward = RewardConfig()
    reward.custom_reward_function.path = str(fn)
    worker = RewardWorker(TOKENIZER, prompts_of(["a", "b", "c"], source="my/task"), reward)
    assert worker.compute_reward(batch_of(["x", "y"], [2, 1])).token_level_scores.sum(-1).tolist() == [2.0, 1.0]


RECORDING_FUNCTION = """import json

def compute_score(**kwargs):
    with open(kwargs["record_to"], "a") as f:
        f.write(json.dumps(kwargs) + "\\n")
    kwargs["extra_info"]["touched"] = True  # must not reach the row's own extra_info
    return {"score": 0.5, "acc": True}
"""


def recorded_calls(tmp_path, tasks: dict[int, TaskRow], texts: list[str], rows: list[int], **reward_kwargs):
    fn = tmp_path / "recording.py"
    fn.write_text(RECORDING_FUNCTION)
    reward = RewardConfig()
    reward.custom_reward_function.path = str(fn)
    reward.custom_reward_function.reward_kwargs = {"record_to": str(tmp_path / "calls.jsonl"), **reward_kwargs}
    n = len(tasks)
    prompts = PromptSet([[1]] * n, list(tasks), [[]] * n, [None] * n, "sha", n, tasks=tasks)
    scores = RewardWorker(TOKENIZER, prompts, reward).compute_reward(batch_of(texts, rows)).token_level_scores
    assert scores.sum(-1).tolist() == [0.5] * len(texts)
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def test_the_users_function_gets_verls_keyword_arguments_and_reward_kwargs(tmp_path):
    tasks = {0: TaskRow("my/task", "7", {"index": 0, "split": "train"}), 1: TaskRow("my/task", ["a", "b"], None)}
    calls = recorded_calls(tmp_path, tasks, ["so 7", "b"], [0, 1], format_score=0.1)
    record_to = str(tmp_path / "calls.jsonl")
    verl_turns = {"num_turns": 2, "rollout_reward_scores": {}}  # verl's single-turn agent loop, no tool scores
    assert calls == [
        {
            "data_source": "my/task",
            "solution_str": "so 7",
            "ground_truth": "7",
            "extra_info": {"index": 0, "split": "train", **verl_turns},
            "record_to": record_to,
            "format_score": 0.1,
        },
        {  # a row without extra_info: {} (verl's default), never None
            "data_source": "my/task",
            "solution_str": "b",
            "ground_truth": ["a", "b"],
            "extra_info": verl_turns,
            "record_to": record_to,
            "format_score": 0.1,
        },
    ]
    assert tasks[0].extra_info == {"index": 0, "split": "train"} and tasks[1].extra_info is None


def test_reward_kwargs_win_over_the_managers_arguments_as_in_verl(tmp_path):
    calls = recorded_calls(tmp_path, {0: TaskRow("my/task", "7", None)}, ["7"], [0], data_source="forced")
    assert calls[0]["data_source"] == "forced"


def test_the_rules_are_called_with_the_same_arguments(monkeypatch):
    seen = []
    worker = RewardWorker(TOKENIZER, prompts_of(["7"]), RewardConfig())
    monkeypatch.setattr(worker, "compute_score", lambda **kwargs: seen.append(kwargs) or 1.0)
    worker.compute_reward(batch_of(["#### 7"], [0]))
    assert seen == [
        {
            "data_source": "openai/gsm8k",
            "solution_str": "#### 7",
            "ground_truth": "7",
            "extra_info": {"index": 0, "num_turns": 2, "rollout_reward_scores": {}},
        }
    ]


@pytest.mark.parametrize(
    "source, truth, message",
    [
        ("codecontests", "x", r"no task-reward rule for data_source 'codecontests' \(verl scores it by running"),
        ("my/task", "x", r"rules: openai/gsm8k, .*searchR1_bamboogle, miniverl/toy_arithmetic, aime\*\)"),
        ("searchR1_nq", "Paris", r"the searchR1_nq rule reads \{'target': <answer or list of answers>\}"),
        ("hiyouga/geometry3k", 30, r"reward_model.ground_truth is 30 \(int\); the hiyouga/geometry3k rule compares"),
    ],
)
def test_a_row_a_rule_cannot_score_is_one_line(source, truth, message):
    with pytest.raises(MiniverlError, match=message) as error:
        RewardWorker(TOKENIZER, prompts_of([truth], source=source), RewardConfig())
    assert "\n" not in str(error.value)


def test_the_new_rules_score_their_rows():
    search = prompts_of([{"target": ["Paris", "paris france"]}], source="searchR1_nq")
    numina = prompts_of([12], source="numina_cn_k12")  # verl's numina rule compares str(ground truth)
    dapo = prompts_of(["12"], source="aime24")
    got = [
        RewardWorker(TOKENIZER, prompts, RewardConfig()).compute_reward(batch_of([text], [0])).token_level_scores.sum()
        for prompts, text in ((search, "<answer>Paris</answer>"), (numina, "The answer is 12."), (dapo, "Answer: 13"))
    ]
    assert [float(g) for g in got] == [1.0, 1.0, -1.0]
