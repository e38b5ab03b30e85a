"""Task rewards beside distillation (`estimator.use_task_rewards=true`), as verl's
`distillation_ppo_loss`: `task_policy_loss` is verl's PPO loss on the task advantages (the actor's clip
ratios and loss_agg_mode), `distillation_ppo_loss` adds `distillation_loss_coef` x the distillation
loss of `losses`. Normalisers as in `losses`: per chunk, those of the whole mini-batch.

Shapes: B rows, T padded response positions.
"""

from __future__ import annotations

import torch

from miniverl.config.actor import ActorConfig
from miniverl.config.estimator import EstimatorConfig
from miniverl.workers.losses import Number, agg_loss, ppo_clip_losses


def task_policy_loss(
    actor_config: ActorConfig,
    loss_agg_mode: str,
    log_prob: torch.Tensor,  # (B, T) with the gradient
    old_log_prob: torch.Tensor | None,  # (B, T); None: on-policy, log_prob.detach()
    advantages: torch.Tensor,  # (B, T) the task advantages
    response_mask: torch.Tensor,  # (B, T)
    *,
    batch_num_tokens: Number | None,
    global_batch_size: Number | None,
    loss_scale_factor: Number | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's `ppo_loss` on the task advantages (vanilla policy loss, the actor's clip ratios and
    loss_agg_mode): (pg_loss, {pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower})."""
    mask, clip = response_mask.bool(), actor_config
    old = log_prob.detach() if old_log_prob is None else old_log_prob
    pg_losses, metrics = ppo_clip_losses(
        log_prob,
        old,
        advantages.detach(),
        mask,
        clip_ratio_low=clip.clip_ratio if clip.clip_ratio_low is None else clip.clip_ratio_low,
        clip_ratio_high=clip.clip_ratio if clip.clip_ratio_high is None else clip.clip_ratio_high,
        clip_ratio_c=clip.clip_ratio_c,
    )
    pg_loss = agg_loss(
        pg_losses,
        mask,
        loss_agg_mode,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    metrics["pg_loss"] = float(pg_loss.detach())
    return pg_loss, metrics


def distillation_ppo_loss(
    est: EstimatorConfig,
    actor_config: ActorConfig,
    distill_loss: torch.Tensor,  # the distillation loss of the (micro-)batch, with its graph
    log_prob: torch.Tensor,  # (B, T) with the gradient
    old_log_prob: torch.Tensor | None,  # (B, T); None: on-policy
    task_advantages: torch.Tensor | None,  # (B, T); read only with task rewards
    response_mask: torch.Tensor,  # (B, T)
    **normalisers: Number | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's `distillation_ppo_loss`: with task rewards, the task PPO loss (`task_policy_loss`) +
    distillation_loss_coef x the distillation loss, and the task loss's metrics; without, the
    distillation loss alone (the coefficient is not read). Given advantages without task rewards,
    the task loss's metrics are still computed, as verl computes and drops that loss; the trainer
    gives none then."""
    pg_loss, metrics = None, {}
    if task_advantages is not None:
        pg_loss, metrics = task_policy_loss(
            actor_config, est.loss_agg_mode, log_prob, old_log_prob, task_advantages, response_mask, **normalisers
        )
    if not est.use_task_rewards:
        return distill_loss, metrics
    return pg_loss + distill_loss * est.distillation_loss_coef, metrics
