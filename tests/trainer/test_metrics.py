"""The batch's own metrics (trainer/metrics.py), each against its value worked out by hand: verl's
response_length/*, prompt_length/*, with task rewards critic/* over the response tokens only, and its
timing_per_token_ms/* and perf/* of the update's phases."""

from __future__ import annotations

import pytest
import torch

from miniverl.config.recipe import RecipeConfig
from miniverl.protocol import assemble
from miniverl.trainer.metrics import batch_metrics, task_metrics, time_metrics

LIMITS = RecipeConfig(prompt_limit=5, response_limit=4)


def two_rows():
    """Row 0: a 3-token prompt (left-padded to 5), a response at the limit of 4; row 1: 5 and 2."""
    prompts = torch.tensor([[0, 0, 7, 8, 9], [3, 4, 5, 6, 7]])
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    response_mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    responses = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    return assemble(prompts, prompt_mask, responses, response_mask, torch.zeros(2, 4), torch.arange(2))


def test_lengths_of_responses_and_prompts():
    m = batch_metrics(two_rows(), LIMITS)
    assert (m["response_length/mean"], m["response_length/max"], m["response_length/min"]) == (3.0, 4.0, 2.0)
    assert m["response_length/sum"] == 6.0
    assert m["response_length/clip_ratio"] == 0.5  # row 0 reached the limit, row 1 stopped before
    assert (m["prompt_length/mean"], m["prompt_length/max"], m["prompt_length/min"]) == (4.0, 5.0, 3.0)  # no padding
    assert m["prompt_length/clip_ratio"] == 0.5  # row 1's prompt is at recipe.prompt_limit
    longer = batch_metrics(two_rows(), RecipeConfig(prompt_limit=6, response_limit=4))
    assert longer["prompt_length/clip_ratio"] == 0.0  # the limit, not the batch's widest prompt


def test_per_token_times_and_throughput_are_verls():
    """gen per response token, update_actor per prompt and response token (6 + 8 here), as verl's
    compute_timing_metrics; the teacher's phase, which verl has no per-token name for, has none."""
    seconds = {"gen": 0.6, "teacher": 0.2, "update_actor": 0.7, "step": 1.5}
    m = time_metrics(two_rows(), seconds, torch.device("cpu"))
    assert m["timing_s/gen"] == 0.6 and m["timing_s/teacher"] == 0.2
    assert m["timing_per_token_ms/gen"] == pytest.approx(100.0)
    assert m["timing_per_token_ms/update_actor"] == pytest.approx(50.0)
    assert "timing_per_token_ms/teacher" not in m and "timing_per_token_ms/adv" not in m
    assert m["perf/total_num_tokens"] == 14 and m["perf/time_per_step"] == 1.5
    assert m["perf/throughput"] == pytest.approx(14 / 1.5)
    assert m["perf/cpu_memory_used_gb"] > 0 and "perf/max_memory_allocated_gb" not in m  # CUDA's peaks on CUDA


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
