"""Task advantages (verl: `compute_advantage` with its critic-free outcome estimators, in
trainer/ppo/core_algos.py; here beside the losses, which the conformance checks also call), from the
task reward of each sample, over the `rollout.n` samples of each prompt (a group).

Shapes: B samples, R response positions. `index` (B,) names each sample's group (verl's `uid`);
in a batch the n samples of a prompt are adjacent rows, so the group of row i is i // n.
"""

from __future__ import annotations

import torch

from miniverl.config.algorithm import AlgorithmConfig
from miniverl.protocol import Batch

GRPO_EPSILON = 1e-6  # verl's default epsilon of the group std


def grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,  # (B, R)
    response_mask: torch.Tensor,  # (B, R)
    index: torch.Tensor,  # (B,)
    *,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = GRPO_EPSILON,
) -> torch.Tensor:
    """(score - group mean) / (group std + eps) on every response token (without the std: Dr. GRPO).
    A group of one sample has mean 0 and std 1, as in verl; the std is the unbiased one."""
    scores = token_level_rewards.sum(-1)  # (B,) one outcome per sample
    advantages = torch.empty_like(scores)
    for group in index.unique():
        members = index == group
        group_scores = scores[members]
        if group_scores.numel() == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = group_scores.mean(), group_scores.std()
        centred = group_scores - mean
        advantages[members] = centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred
    return advantages[:, None] * response_mask  # (B, R)


def rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,  # (B, R)
    response_mask: torch.Tensor,  # (B, R)
    index: torch.Tensor,  # (B,)
) -> torch.Tensor:
    """Leave-one-out: score minus the mean of the group's other samples, written as verl writes it
    (n/(n-1) x score - n/(n-1) x group mean); a group of one keeps its score."""
    scores = token_level_rewards.sum(-1)  # (B,)
    advantages = scores.clone()
    for group in index.unique():
        members = index == group
        n = int(members.sum())
        if n > 1:
            group_scores = scores[members]
            advantages[members] = group_scores * n / (n - 1) - group_scores.mean() * n / (n - 1)
    return advantages[:, None] * response_mask  # (B, R)


def compute_advantage(batch: Batch, algorithm: AlgorithmConfig, samples_per_prompt: int) -> Batch:
    """Fills task_advantages (B, R) from token_level_scores (no KL in the reward: rewards = scores)."""
    index = torch.arange(len(batch), device=batch.responses.device) // samples_per_prompt  # (B,) group of each sample
    rewards, mask = batch.token_level_scores, batch.response_mask
    if algorithm.adv_estimator == "grpo":
        advantages = grpo_outcome_advantage(
            rewards, mask, index, norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo
        )
    else:
        advantages = rloo_outcome_advantage(rewards, mask, index)
    batch.task_advantages = advantages
    return batch
