"""Task advantages: GRPO and RLOO equal verl v0.8.0's on the same rewards (golden values made by
verl's own functions), and a batch groups each prompt's rollout.n adjacent samples."""

from __future__ import annotations

import json

import pytest
import torch

from miniverl.config.algorithm import AlgorithmConfig
from miniverl.protocol import Batch
from miniverl.workers.advantages import compute_advantage, grpo_outcome_advantage, rloo_outcome_advantage

from conftest import DATA

GOLDEN = json.loads((DATA / "verl-0.8.0-task-rewards.json").read_text())
ADVANTAGE_CASES = [c for c in GOLDEN["cases"] if c["kind"] in ("grpo_advantage", "rloo_advantage")]


@pytest.mark.parametrize("case", ADVANTAGE_CASES, ids=lambda c: f"{c['kind']}-{c.get('norm_adv_by_std_in_grpo')}")
def test_advantages_equal_verls_on_the_same_rewards(case):
    inp = case["inputs"]
    rewards, mask = torch.tensor(inp["token_level_rewards"]), torch.tensor(inp["response_mask"])
    index = torch.tensor(inp["index"])
    if case["kind"] == "grpo_advantage":
        got = grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=case["norm_adv_by_std_in_grpo"])
    else:
        got = rloo_outcome_advantage(rewards, mask, index)
    expected = torch.tensor(case["expected"]["advantages"])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert (expected != 0).any()  # the golden case is not trivially zero


def batch_of(scores: list[float], lengths: list[int]) -> Batch:
    b, r = len(scores), max(lengths)
    mask = torch.zeros(b, r)
    token_scores = torch.zeros(b, r)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1
        token_scores[i, n - 1] = s
    empty = torch.zeros(b, 1, dtype=torch.long)
    batch = Batch(empty[:, 0], empty, mask.long(), empty, empty, empty, mask, mask)
    batch.token_level_scores = token_scores
    return batch


def test_a_batch_groups_the_adjacent_samples_of_each_prompt():
    # Two prompts, three samples each: [1, 0, 0] and [1, 1, 1] (an all-alike group has no advantage).
    batch = compute_advantage(batch_of([1, 0, 0, 1, 1, 1], [2, 3, 1, 2, 2, 3]), AlgorithmConfig(), 3)
    first = torch.tensor([1.0, 0.0, 0.0])
    expected = (first - first.mean()) / (first.std() + 1e-6)
    assert torch.allclose(batch.task_advantages[:3, 0], expected)
    assert torch.equal(batch.task_advantages[3:], torch.zeros(3, 3))
    # Every response token carries its sample's advantage; padding carries none.
    assert torch.equal(batch.task_advantages[1], expected[1].repeat(3))
    assert batch.task_advantages[2, 1:].abs().sum() == 0


def test_rloo_and_dr_grpo_are_options_of_algorithm():
    scores, lengths = [1, 0, 0, 0], [1, 1, 1, 1]
    rloo = compute_advantage(batch_of(scores, lengths), AlgorithmConfig(adv_estimator="rloo"), 4)
    assert torch.allclose(rloo.task_advantages[:, 0], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    dr = compute_advantage(batch_of(scores, lengths), AlgorithmConfig(norm_adv_by_std_in_grpo=False), 4)
    assert torch.allclose(dr.task_advantages[:, 0], torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_gae_is_refused_in_one_line():
    with pytest.raises(ValueError, match="gae needs a critic"):
        AlgorithmConfig(adv_estimator="gae")
