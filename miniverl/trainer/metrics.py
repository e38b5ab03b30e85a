"""Per-update metrics that describe the batch itself (verl's response_length/* and prompt_length/*,
with task rewards its critic/score/*, critic/rewards/*, critic/advantages/*, critic/returns/*),
and the console line of an update."""

from __future__ import annotations

import torch

from miniverl.protocol import Batch
from miniverl.utils.run_names import LOSS_KEY, SCORE_KEY


def batch_metrics(batch: Batch, response_limit: int) -> dict:
    lengths = batch.response_mask.sum(-1)  # (B,)
    prompt_lengths = batch.attention_mask[:, : batch.prompt_length].sum(-1).float()
    return {
        **(task_metrics(batch) if batch.token_level_scores is not None else {}),
        **(alignment_metrics(batch) if batch.student_span is not None else {}),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= response_limit).float().mean()),
        "response_length/sum": float(lengths.sum()),
        "prompt_length/mean": float(prompt_lengths.mean()),
        "prompt_length/max": float(prompt_lengths.max()),
    }


def alignment_metrics(batch: Batch) -> dict:
    """A teacher with another tokenizer: the fraction of response tokens left out as unaligned, the
    teacher's log-likelihood of the responses' text per character, and with a floor for the bytes
    the teacher cannot write the fraction of the text's bytes scored at it (miniverl's names)."""
    tokens, chars = float(batch.response_mask.sum()), float(batch.response_chars.sum())
    out = {
        "distillation/unaligned_fraction": 1.0 - float(batch.scored_mask.sum()) / tokens if tokens else 0.0,
        "distillation/teacher_loglik_per_char": float(batch.teacher_text_logprobs.sum()) / chars if chars else 0.0,
    }
    if batch.unwritable_bytes is not None:
        text_bytes = float(batch.response_bytes.sum())
        out["distillation/unwritable_byte_fraction"] = (
            float(batch.unwritable_bytes.sum()) / text_bytes if text_bytes else 0.0
        )
    return out


def task_metrics(batch: Batch) -> dict:
    """verl's critic/* metrics of a critic-free estimator: per-sample scores (= rewards: no KL in the
    reward) and per-token advantages (= returns for the outcome estimators), over response tokens."""
    scores = batch.token_level_scores.sum(-1)  # (B,)
    advantages = torch.masked_select(batch.task_advantages, batch.response_mask.bool())  # (N,)
    out = {}
    for name, values in (("score", scores), ("rewards", scores), ("advantages", advantages), ("returns", advantages)):
        out.update(
            {
                f"critic/{name}/mean": float(values.mean()),
                f"critic/{name}/max": float(values.max()),
                f"critic/{name}/min": float(values.min()),
            }
        )
    return out


def console_line(metrics: dict) -> str:
    keys = (LOSS_KEY, SCORE_KEY, "actor/grad_norm", "response_length/mean", "timing_s/step")
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
