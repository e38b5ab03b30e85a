"""The reward role: each response decoded without its special tokens is scored against its row's
ground truth, the score placed at the sample's last response token; a failing function of the
user's is one line naming the row."""

from __future__ import annotations

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
