"""Per-update metrics that describe the batch itself (verl's response_length/* and prompt_length/*,
with task rewards its critic/score/*, critic/rewards/*, critic/advantages/*, critic/returns/*), the
update's place in the data (training/*), its times and throughput (timing_s/*, timing_per_token_ms/*,
perf/*: verl's compute_timing_metrics and compute_throughout_metrics, and its actor's memory figures),
and the console line of an update."""

from __future__ import annotations

import psutil
import torch

from miniverl.config.recipe import RecipeConfig
from miniverl.protocol import Batch
from miniverl.utils.measure import GIB, cuda_peaks
from miniverl.utils.run_names import LOSS_KEY, SCORE_KEY


def batch_metrics(batch: Batch, recipe: RecipeConfig) -> dict:
    """verl's compute_data_metrics of the batch; a prompt or response "clipped" is one at its limit
    (recipe.prompt_limit, recipe.response_limit: verl pads both to theirs)."""
    lengths = batch.response_mask.sum(-1)  # (B,)
    prompt_lengths = batch.attention_mask[:, : batch.prompt_length].sum(-1).float()  # (B,)
    return {
        **(task_metrics(batch) if batch.token_level_scores is not None else {}),
        **(alignment_metrics(batch) if batch.student_span is not None else {}),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= recipe.response_limit).float().mean()),
        "response_length/sum": float(lengths.sum()),
        "prompt_length/mean": float(prompt_lengths.mean()),
        "prompt_length/max": float(prompt_lengths.max()),
        "prompt_length/min": float(prompt_lengths.min()),
        "prompt_length/clip_ratio": float((prompt_lengths >= recipe.prompt_limit).float().mean()),
    }


def step_metrics(update: int, epoch: int) -> dict:
    """Where the update stands: verl's global step (1-based) and epoch (0-based: the pass over the prompts)."""
    return {"training/global_step": update, "training/epoch": epoch}


def time_metrics(batch: Batch, seconds: dict[str, float], device: torch.device) -> dict:
    """timing_s/<phase>; per token in ms for verl's phases (gen per response token, adv and update_actor per
    prompt and response token); the step's tokens per second on this one device; the memory verl's actor
    logs after its update (the device's peaks on CUDA, the machine's used memory)."""
    response_tokens = float(batch.response_mask.sum())
    all_tokens = float(batch.attention_mask.sum())  # prompt + response, padding left out (verl's global_token_num)
    per_token = {"gen": response_tokens, "adv": all_tokens, "update_actor": all_tokens}
    out = {f"timing_s/{phase}": round(value, 6) for phase, value in seconds.items()}
    out.update({f"timing_per_token_ms/{p}": seconds[p] * 1000 / per_token[p] for p in per_token if p in seconds})
    out.update(
        {
            "perf/total_num_tokens": int(all_tokens),
            "perf/time_per_step": seconds["step"],
            "perf/throughput": all_tokens / seconds["step"],  # verl divides by its GPUs too: one here
            "perf/cpu_memory_used_gb": psutil.virtual_memory().used / GIB,
        }
    )
    allocated, reserved = cuda_peaks(device)  # nulls off CUDA
    if allocated is not None:
        out.update({"perf/max_memory_allocated_gb": allocated, "perf/max_memory_reserved_gb": reserved})
    return out


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
