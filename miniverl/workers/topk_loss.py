"""The top-k forward KL(teacher || student) distillation loss, as verl v0.8.0's fsdp
`compute_forward_kl_topk` (see docs/losses.md), with verl v0.9's opt-in chunked path
(`estimator.use_chunked_topk`), and miniverl's `forward_kl_topk_tail` (verl RFC #7856 / PR #7855, not
in any verl release): the same top-k sum plus one tail bucket per distribution (`tail_bucket_kl`).

Computed from the student's logits and the teacher's k most likely tokens per position; it ends as
the single-sample estimators do (`miniverl.workers.losses.finish_loss`).

Shapes: B rows, T padded response positions, V vocabulary, k top-k width, N = B*T positions.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from miniverl.config.estimator import EstimatorConfig
from miniverl.workers.losses import Number, finish_loss, masked_range


class TopkTerms(NamedTuple):
    """Per-position results of the top-k forward KL, each (B, T)."""

    per_token_loss: torch.Tensor  # sum_k p_t (log p_t - log p_s), not yet clamped at 0; has grad
    student_mass: torch.Tensor  # student probability on the teacher's top-k ids
    teacher_mass: torch.Tensor  # teacher probability on its own top-k ids
    overlap_count: torch.Tensor  # |teacher top-k ids  intersect  student top-k ids| (int64)
    overlap_token_advantage: torch.Tensor  # mean of -p_t (log p_t - log p_s) over overlapping ids; 0 if none
    # forward_kl_topk_tail's inputs (None only in terms built without them; forward_kl_topk ignores both):
    # log Q_K = logsumexp of the student's log-probs at the teacher's top-k ids, with the student's graph, and
    # log P_K = logsumexp of the teacher's top-k log-probs (no graph); both from the log-probs before
    # log_prob_min_clamp.
    student_log_mass: torch.Tensor | None = None
    teacher_log_mass: torch.Tensor | None = None


def _positions(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows start..stop-1 of the B*T positions of x (B, T, ...), row-major, as (stop - start, ...): a view
    when they lie in one row of x or x is contiguous, else one copy of just these rows (never of x)."""
    if x.is_contiguous():
        return x.view(-1, *x.shape[2:])[start:stop]
    width, parts = x.shape[1], []
    while start < stop:
        b, t = divmod(start, width)
        take = min(stop - start, width - t)
        parts.append(x[b, t : t + take])
        start += take
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _ChunkedTopkLogProbs(torch.autograd.Function):
    """log_softmax(logits) at given ids, and the logits' own top-k ids, `chunk` positions at a time.

    forward(logits (B, T, V), ids (N, k), chunk, dtype) -> (log-probs (N, k) in dtype, top-k ids
    (N, k)), N = B*T. The forward keeps only the logsumexp of each position, (N, 1); the backward
    recomputes the softmax of one chunk at a time, so that no (B, T, V) tensor but the logits
    themselves and their gradient ever exists (nor a float32 copy of bf16/fp16 logits). The backward
    applies autograd's own formula for `x.gather(ids) - logsumexp(x)` (the gradient scattered at the
    ids, minus the softmax times its sum), in the same order: the unchunked path's numbers.
    """

    @staticmethod
    def forward(ctx, logits, ids, chunk, dtype):
        n, k = ids.shape
        log_probs = torch.empty(n, k, dtype=dtype, device=logits.device)
        log_z = torch.empty(n, 1, dtype=dtype, device=logits.device)
        top_ids = torch.empty(n, k, dtype=torch.long, device=logits.device)
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            x = _positions(logits, rows.start, rows.stop).to(dtype)  # (c, V): a copy only for bf16/fp16
            log_z[rows] = torch.logsumexp(x, dim=-1, keepdim=True)
            log_probs[rows] = x.gather(-1, ids[rows]) - log_z[rows]
            top_ids[rows] = x.topk(k, dim=-1).indices  # ranking logits == ranking log-probs
        ctx.save_for_backward(logits, ids, log_z)  # the caller's logits, not a copy
        ctx.chunk, ctx.dtype = chunk, dtype
        ctx.mark_non_differentiable(top_ids)
        return log_probs, top_ids

    @staticmethod
    def backward(ctx, grad_log_probs, _grad_top_ids):
        logits, ids, log_z = ctx.saved_tensors
        n = ids.shape[0]
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # the gradient itself
        flat_grad = grad.view(n, logits.shape[-1])  # n may be 0 (a micro-batch of padding only)
        for start in range(0, n, ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, n))
            x = _positions(logits, rows.start, rows.stop).to(ctx.dtype)  # (c, V)
            g = grad_log_probs[rows]  # (c, k)
            through_gather = torch.zeros_like(x).scatter_add_(-1, ids[rows], g)
            # d logsumexp / dx = softmax(x); the gradient reaching log_z is -sum_k g (the subtraction's)
            through_log_z = (-g).sum(-1, keepdim=True) * (x - log_z[rows]).exp()
            flat_grad[rows] = through_gather + through_log_z
        return grad, None, None, None


def chunked_topk_log_probs(
    logits: torch.Tensor, ids: torch.Tensor, chunk: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax(logits) gathered at ids, the logits' top-k ids), each (B, T, k), computed `chunk` of
    the B*T positions at a time in the forward and the backward (verl v0.9's `_chunked_topk_log_probs`
    chunks the forward only: its backward holds every chunk; see `_ChunkedTopkLogProbs`).
    logits: (B, T, V), with or without gradient, any strides; ids: (B, T, k); dtype: of the
    computation (default: the logits' promoted to at least float32)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    dtype = dtype or torch.promote_types(logits.dtype, torch.float32)
    b, t, k = ids.shape
    log_probs, top_ids = _ChunkedTopkLogProbs.apply(logits, ids.reshape(-1, k).long(), chunk, dtype)
    return log_probs.view(b, t, k), top_ids.view(b, t, k)


def forward_kl_topk_terms(
    student_logits: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    *,
    log_prob_min_clamp: float | None = None,
    chunk_size: int | None = None,
) -> TopkTerms:
    """Top-k forward KL(teacher || student) per position, as verl's fsdp compute_forward_kl_topk, and the
    top-k log-masses that forward_kl_topk_tail adds its tail bucket from (`TopkTerms.student_log_mass`,
    `teacher_log_mass`: O(k) per position, computed whatever the loss mode, so that callers need not know it).

    student_logits: (B, T, V); teacher_topk_log_probs, teacher_topk_ids: (B, T, k). Ids must be valid
    vocabulary indices at every position (pad with any id, e.g. 0; padded positions are masked later).
    Works on any chunk of positions. Computed in at least float32 (verl casts the KL to float32).
    Memory: the student log-probs are gathered at k ids and normalised by logsumexp instead of
    materialising log_softmax. chunk_size None: in one piece (a float32 copy of bf16/fp16 logits,
    and (B, T, V) temporaries inside logsumexp and its backward); an integer (use_chunked_topk): that
    many of the B*T positions at a time, forward and backward, with the same numbers.
    """
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    ids = teacher_topk_ids.long()  # (B, T, k)
    k = ids.shape[-1]
    if chunk_size is None:
        logits = student_logits.to(dtype)  # (B, T, V) a copy only for half-precision logits
        log_z = torch.logsumexp(logits, dim=-1, keepdim=True)  # (B, T, 1)
        student_lp = logits.gather(-1, ids) - log_z  # (B, T, k) student log-probs at the teacher's ids
        with torch.no_grad():
            # Student's own top-k, for the overlap diagnostics (ranking logits == ranking log-probs).
            student_ids = logits.topk(k, dim=-1).indices  # (B, T, k)
    else:
        student_lp, student_ids = chunked_topk_log_probs(student_logits, ids, chunk_size, dtype)  # (B, T, k) each
    teacher_lp = teacher_topk_log_probs.to(dtype)  # (B, T, k)
    with torch.no_grad():
        # Masses use the unclamped log-probs; they show how much of each distribution top-k covers.
        student_mass = student_lp.exp().sum(-1)  # (B, T)
        teacher_mass = teacher_lp.exp().sum(-1)  # (B, T)
        teacher_log_mass = torch.logsumexp(teacher_lp, dim=-1)  # (B, T) log P_K
    # log Q_K with the graph: forward_kl_topk_tail's tail bucket differentiates through it (unused otherwise).
    student_log_mass = torch.logsumexp(student_lp, dim=-1)  # (B, T)
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
    return TopkTerms(
        per_token, student_mass, teacher_mass, overlap_count, overlap_adv, student_log_mass, teacher_log_mass
    )


_LOG_HALF = -math.log(2.0)


def _log1mexp(log_mass: torch.Tensor, floor: float) -> torch.Tensor:
    """log(max(1 - exp(log_mass), floor)) elementwise, for log-masses log_mass <= 0 (one above 0, a mass
    rounded past 1, gets the floor).

    Maechler's split (Rmpfr's "log1mexp" note): log(-expm1(a)) for a > -log 2, where 1 - e^a is small and
    expm1 keeps it exact; log1p(-exp(a)) below, where 1 - e^a is near 1 and log1p keeps its log exact. The
    branch not taken is fed a clamped input so that it stays finite, and so does its (zeroed) gradient:
    torch.where would otherwise turn 0 * inf into NaN. Where the floor applies the gradient is 0.
    """
    near = (-torch.expm1(log_mass)).clamp_min(floor).log()
    far = torch.log1p(-torch.exp(log_mass.clamp_max(_LOG_HALF)))
    return torch.where(log_mass > _LOG_HALF, near, far)


def tail_bucket_kl(teacher_log_mass: torch.Tensor, student_log_mass: torch.Tensor) -> torch.Tensor:
    """The tail bucket of forward_kl_topk_tail: (1 - P_K) (log(1 - P_K) - log(1 - Q_K)), elementwise.

    teacher_log_mass = log P_K, student_log_mass = log Q_K (any equal shapes, e.g. (B, T)): the log of each
    distribution's mass on the teacher's top-k ids K (`TopkTerms`); the gradient flows through
    student_log_mass. Added to the top-k sum sum_{i in K} p_i (log p_i - log q_i) it makes the KL between
    the two (k+1)-category distributions (p_K, 1 - P_K) and (q_K, 1 - Q_K): >= 0, 0 iff they are equal.

    Numerics (computed in the log-masses' dtype):
      * the complements are formed in log space from the log-masses, log(1 - M) = log1mexp(log M)
        (`_log1mexp`), never as 1 - sum(p);
      * teacher: the weight 1 - P_K = -expm1(log P_K) is clamped to [0, 1] (a top-k whose rounded mass
        reaches 1, as with k = V, weighs 0) and its log is floored at finfo(dtype).tiny, so that
        0 * log 0 = 0 and nothing is inf or NaN;
      * student: log(1 - Q_K) is floored at log(finfo(dtype).eps), with gradient 0 where the floor
        applies. log Q_K near 0 is only resolved to about eps * max(1, |log Z|) (the student's log-probs
        are logits - log Z, and logsumexp's log(sum) has sum >= 1), so a student tail below that is
        rounding noise, often exactly 0: flooring at eps rather than at `tiny` bounds what such a tail
        charges at (1 - P_K) (log(1 - P_K) + 16) nats in float32 (+ 36 in float64) instead of + 87
        (+ 708). So the loss is >= 0 up to rounding, exactly 0 when the two top-k log-prob vectors are
        equal and their tails above eps.
    The gradient w.r.t. the student's logits z_j is then exact where no floor applies: together with the
    top-k sum's, q_j - p_j for j in K and q_j (P_K - Q_K) / (1 - Q_K) for j outside K.
    """
    finfo = torch.finfo(student_log_mass.dtype)
    teacher_log_mass = teacher_log_mass.to(student_log_mass.dtype)
    teacher_tail = (-torch.expm1(teacher_log_mass)).clamp(0.0, 1.0)  # 1 - P_K
    log_teacher_tail = _log1mexp(teacher_log_mass, finfo.tiny)
    log_student_tail = _log1mexp(student_log_mass, finfo.eps)
    return teacher_tail * (log_teacher_tail - log_student_tail)


def topk_chunk_size(est: EstimatorConfig) -> int | None:
    """Positions per chunk of the top-k log-probs: est.chunked_topk_chunk_size with
    est.use_chunked_topk, else None (one piece)."""
    return est.chunked_topk_chunk_size if est.use_chunked_topk else None


def forward_kl_topk(
    est: EstimatorConfig,
    student_logits: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    response_mask: torch.Tensor,
    **normalisers_and_log_probs: Any,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Top-k forward-KL distillation loss for one (micro-)batch: forward_kl_topk, or forward_kl_topk_tail
    (per `est.loss_mode`, see `topk_distillation_loss`).

    student_logits: (B, T, V) with the gradient; teacher_topk_*: (B, T, k); response_mask: (B, T).
    Keyword arguments are those of `topk_distillation_loss`: the normalisers (batch_num_tokens,
    global_batch_size, loss_scale_factor) and, only with use_policy_gradient, log_prob/old_log_prob
    (B, T) of the sampled tokens (then the top-k loss is just the advantage; verl warns that this
    wastes the top-k signal).
    Returns (loss scalar, per-token loss (B, T) clamped at 0 and at loss_max_clamp, metrics).
    Metrics: distillation/student_mass, teacher_mass (+ _min/_max), overlap_ratio,
    overlap_token_advantage, overlap_position_frac (miniverl extra), loss_min, loss_max.
    With est.use_chunked_topk the student's log-probs are formed est.chunked_topk_chunk_size
    positions at a time (forward and backward): no (B, T, V) float tensor but the logits and their
    gradient.
    """
    terms = forward_kl_topk_terms(
        student_logits,
        teacher_topk_log_probs,
        teacher_topk_ids,
        log_prob_min_clamp=est.log_prob_min_clamp,
        chunk_size=topk_chunk_size(est),
    )
    return topk_distillation_loss(est, terms, response_mask, **normalisers_and_log_probs)


def topk_distillation_loss(
    est: EstimatorConfig,
    terms: TopkTerms,
    response_mask: torch.Tensor,
    *,
    batch_num_tokens: Number | None,
    global_batch_size: Number | None,
    loss_scale_factor: Number | None = None,
    log_prob: torch.Tensor | None = None,
    old_log_prob: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The loss and metrics of `forward_kl_topk` from per-position terms (however they were chunked).

    est.loss_mode forward_kl_topk (verl's), p the teacher, q the student, K the teacher's top-k ids:
        loss_t = max(0, sum_{i in K} p_i (log p_i - log q_i))
    (floored at 0: the truncated sum is not a divergence, it is < 0 wherever Q_K outweighs P_K).
    est.loss_mode forward_kl_topk_tail (verl RFC #7856 / PR #7855), P_K = sum_K p_i, Q_K = sum_K q_i:
        loss_t = sum_{i in K} p_i (log p_i - log q_i) + (1 - P_K) (log(1 - P_K) - log(1 - Q_K))
    the KL between the (k+1)-category distributions (p_K, 1 - P_K) and (q_K, 1 - Q_K): >= 0, not floored
    at 0 (see `tail_bucket_kl` for the numerics); the gradient reaches the student's logits through both
    the q_i and Q_K. loss_max_clamp applies to either (as verl's distillation_loss applies it to every loss).
    With log_prob_min_clamp the top-k sum takes the floored log-probs, as forward_kl_topk does, while the
    tail bucket takes the unfloored masses P_K, Q_K (the true tails): the per-token loss is exactly
    forward_kl_topk's top-k sum (before its floor at 0) plus the tail bucket. Where the floor bites (a
    log-prob below it counts as the floor) the top-k terms no longer belong to a distribution, so there
    the total is not a KL and can come out slightly below 0; it is left so. Extra metric of the tail mode:
    distillation/tail_kl, the token mean of the tail bucket (before loss_max_clamp).
    """
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
    if est.loss_mode == "forward_kl_topk_tail":
        if terms.student_log_mass is None or terms.teacher_log_mass is None:
            raise ValueError("forward_kl_topk_tail needs TopkTerms with student_log_mass and teacher_log_mass")
        tail = tail_bucket_kl(terms.teacher_log_mass, terms.student_log_mass)  # (B, T), with the graph
        with torch.no_grad():
            metrics["distillation/tail_kl"] = float(tail[mask].sum()) / n if n else 0.0
        # A proper KL of the (k+1)-bucket distributions: not floored at 0.
        per_token = terms.per_token_loss + tail
    else:
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
