"""Advantages. The distillation policy gradient's (`policy_gradient_advantages`): minus the per-token
estimate, or with `estimator.kl_discount_factor` the discounted future estimate (tinker-cookbook's),
with `estimator.advantage_baseline` less the update's mean estimate first.
Task advantages (verl: `compute_advantage` with its critic-free outcome estimators, in
trainer/ppo/core_algos.py; here beside the losses, which the conformance checks also call), from the
task reward of each sample, over the `rollout.n` samples of each prompt (a group).

Shapes: B samples, R response positions. `index` (B,) names each sample's group (verl's `uid`);
in a batch the n samples of a prompt are adjacent rows, so the group of row i is i // n.
"""

from __future__ import annotations

import torch

from miniverl.config.algorithm import AlgorithmConfig
from miniverl.config.estimator import EstimatorConfig
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


def discounted_future_sum(values: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """S_t = sum_{s >= t} gamma^(s - t) values_s along the last dimension (each row on its own), over the
    positions of `mask` only: an unmasked position adds nothing and gets 0. (B, R) -> (B, R).

    s - t counts positions, so a hole in the mask still discounts (a response mask has none: it
    is 1 up to EOS). Computed as a log-depth scan: after step k, S_t sums the 2^k positions from t,
    S_t += gamma^(2^k) S_(t + 2^k); ceil(log2 R) elementwise steps, each row independent of the
    others, so a row gives the same bits in any batch (row chunks of a mini-batch included)."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    mask = mask.bool()
    out = torch.where(mask, values, zero)  # (B, R) a new tensor
    width, shift, factor = out.shape[-1], 1, float(gamma)
    while shift < width and factor != 0.0:
        out = torch.cat([out[..., :-shift] + factor * out[..., shift:], out[..., width - shift :]], dim=-1)
        shift, factor = 2 * shift, factor * factor
    return torch.where(mask, out, zero)


def policy_gradient_advantages(
    est: EstimatorConfig, per_token_loss: torch.Tensor, mask: torch.Tensor, baseline: float = 0.0
) -> torch.Tensor:
    """The distillation policy gradient's advantage (B, R) from the per-token loss d (B, R) after
    loss_max_clamp: -d (verl's; est.kl_discount_factor 0 and no baseline, the defaults, return exactly
    -d), or with gamma = est.kl_discount_factor > 0 the discounted future loss
    -sum_{s>=t} gamma^(s-t) (d_s - baseline) over the positions of `mask` (the response), 0 elsewhere
    (tinker-cookbook's `kl_discount_factor`; `baseline`: `distillation_baseline`)."""
    gamma = est.kl_discount_factor
    if baseline:
        per_token_loss = torch.where(mask.bool(), per_token_loss - baseline, per_token_loss.new_zeros(()))
    return -discounted_future_sum(per_token_loss, mask, gamma) if gamma else -per_token_loss
