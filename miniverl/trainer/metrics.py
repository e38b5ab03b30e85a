"""Per-update metrics that describe the batch itself (verl's response_length/* and prompt_length/*),
and the console line of an update."""

from __future__ import annotations

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


def console_line(metrics: dict) -> str:
    keys = ("actor/distillation/loss", "actor/grad_norm", "response_length/mean", "timing_s/step")
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
