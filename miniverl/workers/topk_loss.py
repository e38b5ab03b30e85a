"""The top-k forward KL(teacher || student) distillation loss, as verl v0.8.0's fsdp
`compute_forward_kl_topk` (see docs/losses.md).

Computed from the student's logits and the teacher's k most likely tokens per position; it ends as
the single-sample estimators do (`miniverl.workers.losses.finish_loss`).

Shapes: B rows, T padded response positions, V vocabulary, k top-k width.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from miniverl.workers.losses import Number, finish_loss, masked_range


class TopkTerms(NamedTuple):
    """Per-position results of the top-k forward KL, each (B, T)."""

    per_token_loss: torch.Tensor  # sum_k p_t (log p_t - log p_s), not yet clamped at 0; has grad
    student_mass: torch.Tensor  # student probability on the teacher's top-k ids
    teacher_mass: torch.Tensor  # teacher probability on its own top-k ids
    overlap_count: torch.Tensor  # |teacher top-k ids  intersect  student top-k ids| (int64)
    overlap_token_advantage: torch.Tensor  # mean of -p_t (log p_t - log p_s) over overlapping ids; 0 if none


def forward_kl_topk_terms(
    student_logits: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    *,
    log_prob_min_clamp: float | None = None,
) -> TopkTerms:
    """Top-k forward KL(teacher || student) per position, as verl's fsdp compute_forward_kl_topk.

    student_logits: (B, T, V); teacher_topk_log_probs, teacher_topk_ids: (B, T, k). Ids must be valid
    vocabulary indices at every position (pad with any id, e.g. 0; padded positions are masked later).
    Works on any chunk of positions. Computed in at least float32 (verl casts the KL to float32).
    Memory: only the logits themselves (upcast once if they are bf16/fp16) are (B, T, V): the student
    log-probs are gathered at k ids and normalised by logsumexp instead of materialising log_softmax.
    """
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    logits = student_logits.to(dtype)  # (B, T, V) a copy only for half-precision logits
    ids = teacher_topk_ids.long()  # (B, T, k)
    k = ids.shape[-1]
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)  # (B, T, 1)
    student_lp = logits.gather(-1, ids) - log_z  # (B, T, k) student log-probs at the teacher's ids
    teacher_lp = teacher_topk_log_probs.to(dtype)  # (B, T, k)
    with torch.no_grad():
        # Masses use the unclamped log-probs; they show how much of each distribution top-k covers.
        student_mass = student_lp.exp().sum(-1)  # (B, T)
        teacher_mass = teacher_lp.exp().sum(-1)  # (B, T)
        # Student's own top-k, for the overlap diagnostics (ranking logits == ranking log-probs).
        student_ids = logits.topk(k, dim=-1).indices  # (B, T, k)
    if log_prob_min_clamp is not None:
        # Floors log-probs of near-zero tokens so one of them cannot blow up log p_t - log p_s.
        student_lp = student_lp.clamp_min(log_prob_min_clamp)
        teacher_lp = teacher_lp.clamp_min(log_prob_min_clamp)
    token_kl = teacher_lp.exp() * (teacher_lp - student_lp)  # (B, T, k)
    per_token = token_kl.sum(-1)  # (B, T); may be < 0: the k masses do not sum to 1
    with torch.no_grad():
        overlap = (ids.unsqueeze(-1) == student_ids.unsqueeze(-2)).any(-1)  # (B, T, k) teacher id in student top-k
        overlap_count = overlap.sum(-1)  # (B, T)
        zero = torch.zeros((), dtype=dtype, device=token_kl.device)
        adv_sum = torch.where(overlap, -token_kl, zero).sum(-1)  # (B, T)
        overlap_adv = torch.where(overlap_count > 0, adv_sum / overlap_count.clamp_min(1), zero)
    return TopkTerms(per_token, student_mass, teacher_mass, overlap_count, overlap_adv)


def forward_kl_topk(
    est: Any,
    student_logits: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    response_mask: torch.Tensor,
    **normalisers_and_log_probs: Any,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Top-k forward-KL distillation loss for one (micro-)batch.

    student_logits: (B, T, V) with the gradient; teacher_topk_*: (B, T, k); response_mask: (B, T).
    Keyword arguments are those of `topk_distillation_loss`: the normalisers (batch_num_tokens,
    global_batch_size, loss_scale_factor) and, only with use_policy_gradient, log_prob/old_log_prob
    (B, T) of the sampled tokens (then the top-k loss is just the advantage; verl warns that this
    wastes the top-k signal).
    Returns (loss scalar, per-token loss (B, T) clamped at 0 and at loss_max_clamp, metrics).
    Metrics: distillation/student_mass, teacher_mass (+ _min/_max), overlap_ratio,
    overlap_token_advantage, overlap_position_frac (miniverl extra), loss_min, loss_max.
    """
    terms = forward_kl_topk_terms(
        student_logits, teacher_topk_log_probs, teacher_topk_ids, log_prob_min_clamp=est.log_prob_min_clamp
    )
    return topk_distillation_loss(est, terms, response_mask, **normalisers_and_log_probs)


def topk_distillation_loss(
    est: Any,
    terms: TopkTerms,
    response_mask: torch.Tensor,
    *,
    batch_num_tokens: Number | None,
    global_batch_size: Number | None,
    loss_scale_factor: Number | None = None,
    log_prob: torch.Tensor | None = None,
    old_log_prob: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The loss and metrics of `forward_kl_topk` from per-position terms (however they were chunked)."""
    mask = response_mask.bool()  # (B, T)
    k = est.topk
    with torch.no_grad():
        n = int(mask.sum())
        overlapping = mask & (terms.overlap_count > 0)  # (B, T)
        n_overlap = int(overlapping.sum())
        metrics = {
            "distillation/student_mass": float(terms.student_mass[mask].sum()) / n if n else 0.0,
            "distillation/teacher_mass": float(terms.teacher_mass[mask].sum()) / n if n else 0.0,
            **masked_range(terms.student_mass, mask, "distillation/student_mass"),
            **masked_range(terms.teacher_mass, mask, "distillation/teacher_mass"),
            # Mean fraction of the teacher's top-k that is also in the student's top-k.
            "distillation/overlap_ratio": float(terms.overlap_count[mask].sum()) / n / k if n else 0.0,
            # Mean teacher-token "advantage" over positions that have any overlap (0.0 if none, as verl).
            "distillation/overlap_token_advantage": (
                float(terms.overlap_token_advantage[overlapping].sum()) / n_overlap if n_overlap else 0.0
            ),
            # Not in verl: the share of tokens with overlap, which sizes the mean above when combining.
            "distillation/overlap_position_frac": n_overlap / n if n else 0.0,
        }
    # Top-k masses do not sum to 1, so the sum can dip below 0; verl floors it at 0.
    per_token = terms.per_token_loss.clamp_min(0.0)
    return finish_loss(
        est,
        per_token,
        mask,
        metrics,
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
