"""Per-update metrics that describe the batch itself (verl's response_length/* and prompt_length/*),
and the console line of an update."""

from __future__ import annotations

import torch

from miniverl.protocol import Batch


def batch_metrics(batch: Batch, response_limit: int) -> dict:
    lengths = batch.response_mask.sum(-1)  # (B,)
    prompt_lengths = batch.attention_mask[:, : batch.prompt_length].sum(-1).float()
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= response_limit).float().mean()),
        "response_length/sum": float(lengths.sum()),
        "prompt_length/mean": float(prompt_lengths.mean()),
        "prompt_length/max": float(prompt_lengths.max()),
    }


def rollout_actor_metrics(batch: Batch) -> dict:
    """How far the rollout's log-probs are from the actor's old log-probs (verl's
    `training/rollout_probs_diff_*` debug metrics: absolute differences of the probabilities, over
    response tokens). miniverl's old log-probs come from the update's train-mode forward, verl's
    from its eval-mode recompute. Near zero says bypass_mode would change nothing but rounding."""
    mask = batch.response_mask.bool()
    if not mask.any():
        nan = float("nan")
        return {
            "training/rollout_probs_diff_valid": 0,
            "training/rollout_probs_diff_max": nan,
            "training/rollout_probs_diff_mean": nan,
            "training/rollout_probs_diff_std": nan,
            "training/rollout_actor_probs_pearson_corr": nan,
        }
    actor, rollout = batch.old_log_probs.exp()[mask], batch.rollout_log_probs.exp()[mask]  # (N,) each
    diff = (actor - rollout).abs()
    return {
        "training/rollout_probs_diff_valid": 1,
        "training/rollout_probs_diff_max": float(diff.max()),
        "training/rollout_probs_diff_mean": float(diff.mean()),
        "training/rollout_probs_diff_std": float(diff.std()),
        "training/rollout_actor_probs_pearson_corr": float(torch.corrcoef(torch.stack([actor, rollout]))[0, 1]),
    }


def console_line(metrics: dict) -> str:
    keys = ("actor/distillation/loss", "actor/grad_norm", "response_length/mean", "timing_s/step")
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
