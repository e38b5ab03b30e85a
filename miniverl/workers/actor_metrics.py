"""The actor's own metrics beside its loss: per-teacher losses and how far the rollout's
token probabilities are from the actor's (verl's `training/rollout_probs_diff_*`)."""

from __future__ import annotations

import torch

from miniverl.protocol import Batch
from miniverl.utils.run_names import LOSS_KEY


def per_teacher_losses(per_token_loss: torch.Tensor, batch: Batch, names: tuple[str, ...]) -> dict:
    """`actor/distillation/loss/<teacher>`: the token mean of the per-token distillation loss (B, R),
    after loss_max_clamp, over each teacher's samples; absent for a teacher with no response token
    in this update."""
    metrics = {}
    for i, name in enumerate(names):
        rows = batch.teacher_index == i  # (B,)
        mask = batch.response_mask[rows]
        if tokens := float(mask.sum()):
            metrics[f"{LOSS_KEY}/{name}"] = float((per_token_loss[rows] * mask).sum() / tokens)
    return metrics


def rollout_actor_metrics(batch: Batch) -> dict:
    """How far the rollout's log-probs are from the actor's old log-probs (verl's
    `training/rollout_probs_diff_*` debug metrics: absolute differences of the probabilities, over
    response tokens). miniverl's old log-probs come from the update's train-mode forward, verl's
    from its eval-mode recompute. Near zero says bypass_mode would change nothing but rounding.

    Every value is finite (the checkpoint's history refuses NaN): without response tokens only
    `valid` = 0; the spread of a single token is 0; the Pearson correlation is 1 for two identical
    vectors and left out where one side is constant otherwise (a collapsed student that samples
    every token with probability 1 makes both sides constant), where verl would log NaN."""
    mask = batch.response_mask.bool()
    if not mask.any():
        return {"training/rollout_probs_diff_valid": 0}
    actor, rollout = batch.old_log_probs.exp()[mask], batch.rollout_log_probs.exp()[mask]  # (N,) each
    diff = (actor - rollout).abs()
    metrics = {
        "training/rollout_probs_diff_valid": 1,
        "training/rollout_probs_diff_max": float(diff.max()),
        "training/rollout_probs_diff_mean": float(diff.mean()),
        "training/rollout_probs_diff_std": float(diff.std()) if diff.numel() > 1 else 0.0,
    }
    if torch.equal(actor, rollout):
        metrics["training/rollout_actor_probs_pearson_corr"] = 1.0
    elif actor.numel() > 1 and actor.std() > 0 and rollout.std() > 0:
        corr = torch.corrcoef(torch.stack([actor, rollout]))[0, 1]
        metrics["training/rollout_actor_probs_pearson_corr"] = float(corr)
    return metrics
