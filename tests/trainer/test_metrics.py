"""The batch's own metrics (trainer/metrics.py), each against its value worked out by hand: verl's
response_length/*, prompt_length/* and, with task rewards, critic/* over the response tokens only."""

from __future__ import annotations

import pytest
import torch

from miniverl.protocol import assemble
from miniverl.trainer.metrics import batch_metrics, task_metrics


def two_rows():
    """Row 0: a 3-token prompt (left-padded to 5), a response at the limit of 4; row 1: 5 and 2."""
    prompts = torch.tensor([[0, 0, 7, 8, 9], [3, 4, 5, 6, 7]])
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    response_mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    responses = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    return assemble(prompts, prompt_mask, responses, response_mask, torch.zeros(2, 4), torch.arange(2))


def test_lengths_of_responses_and_prompts():
    m = batch_metrics(two_rows(), response_limit=4)
    assert (m["response_length/mean"], m["response_length/max"], m["response_length/min"]) == (3.0, 4.0, 2.0)
    assert m["response_length/sum"] == 6.0
    assert m["response_length/clip_ratio"] == 0.5  # row 0 reached the limit, row 1 stopped before
    assert (m["prompt_length/mean"], m["prompt_length/max"]) == (4.0, 5.0)  # padding is not prompt


def test_task_metrics_are_per_sample_scores_and_per_response_token_advantages():
    batch = two_rows()
    batch.token_level_scores = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])  # at each last token
    batch.task_advantages = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, 0.0, 0.0]])  # 0: padding
    m = task_metrics(batch)
    assert (m["critic/score/mean"], m["critic/score/max"], m["critic/score/min"]) == (0.5, 1.0, 0.0)
    assert m["critic/rewards/mean"] == m["critic/score/mean"]  # no KL in the reward
    assert m["critic/advantages/mean"] == pytest.approx(2 / 6)  # four +1 and two -1: the padding's 0s left out
    assert (m["critic/advantages/max"], m["critic/advantages/min"]) == (1.0, -1.0)
    assert m["critic/returns/mean"] == m["critic/advantages/mean"]
