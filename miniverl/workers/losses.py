"""On-policy distillation losses, following verl v0.8.0's semantics (see docs/losses.md).

Single-sample estimators of reverse KL(student || teacher) on the sampled token (`kl`/`k1`, `abs`,
`mse`/`k2`, `low_var_kl`/`k3`): `distillation_loss`; the top-k and full-vocabulary losses live in
`topk_loss` and `full_vocab_loss`. All end as verl's `distillation_loss` does: range metrics,
optional clamp to +-loss_max_clamp, then either the vanilla PPO clipped loss with advantage =
-per-token loss (`use_policy_gradient=true`; with `kl_discount_factor` the discounted future loss,
`advantages.policy_gradient_advantages`) or a direct masked aggregation of the per-token loss.

With task rewards (`use_task_rewards=true`), `task_loss.distillation_ppo_loss` adds verl's PPO loss
on the task advantages to `distillation_loss_coef` x the distillation loss.

Normalisers are explicit so that one mini-batch split into micro-batches ("update chunks") gives
per-chunk losses that SUM to the whole mini-batch's loss; metrics returned per chunk combine with
`combine_metrics` into the whole mini-batch's values.

Metrics are plain python floats, keyed without verl's `actor/` prefix.

Shapes: B rows, T padded response positions, V vocabulary, k top-k width.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch

from miniverl.config.estimator import ESTIMATOR_MODES, LOSS_AGG_MODES, EstimatorConfig
from miniverl.utils.text_alignment import credit_to_tokens, span_sums
from miniverl.workers.advantages import policy_gradient_advantages

Number = int | float | torch.Tensor


# verl adds this to denominators of its masked means (verl.utils.torch_functional.masked_mean and the
# per-sequence token mean of agg_loss); kept so float64 results agree with verl to ~1e-12.
_VERL_EPS = 1e-8

# How `combine_metrics` merges each key across micro-batches; any key not listed is a mean over the
# chunk's masked tokens and is combined weighted by the chunk's token count.
MIN_METRICS = frozenset({"distillation/loss_min", "distillation/student_mass_min", "distillation/teacher_mass_min"})
MAX_METRICS = frozenset({"distillation/loss_max", "distillation/student_mass_max", "distillation/teacher_mass_max"})
SUM_METRICS = frozenset({"distillation/loss", "pg_loss"})  # aggregated losses already carry global normalisers
# Means over a subset of tokens: key -> fraction-of-tokens metric that sizes that subset.
SUBSET_MEAN_METRICS = {"distillation/overlap_token_advantage": "distillation/overlap_position_frac"}


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-token single-sample estimate of KL(student || teacher) at the sampled token.

    log_prob: (B, T) student log-prob of the sampled token; ref_log_prob: (B, T) teacher's.
    Returns (B, T). Same formulas and clamps as verl's `kl_penalty` (without the "+" variants, which
    verl's distillation registry does not accept).
    """
    diff = log_prob - ref_log_prob  # (B, T) log(p_s / p_t)
    if mode in ("kl", "k1"):
        return diff  # unbiased but signed; its gradient ignores the teacher unless used as a reward
    if mode == "abs":
        return diff.abs()
    if mode in ("mse", "k2"):
        return 0.5 * diff.square()
    if mode in ("low_var_kl", "k3"):
        # k3 = r - log r - 1 with r = p_t / p_s. verl bounds log r to +-20 before exp (overflow) and the
        # result to [-10, 10] (it is >= 0, so only the upper bound bites); the clamps zero the gradient.
        log_r = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
        return torch.clamp(torch.exp(log_r) - log_r - 1, min=-10, max=10)
    raise ValueError(f"unknown estimator mode {mode!r}; choose one of {', '.join(ESTIMATOR_MODES)}")


class Spans(NamedTuple):
    """A teacher with another tokenizer scores spans of text, not tokens (workers/text_aligned_teacher.py)."""

    student_span: torch.Tensor  # (B, T) long: each token's span, -1 where unaligned
    teacher_log_prob: torch.Tensor  # (B, S) the teacher's log-prob of each span
    credit: str  # last | even: how a span's estimate reaches its tokens


def span_kl_estimate(log_prob: torch.Tensor, spans: Spans, mode: str) -> torch.Tensor:
    """(B, T) the estimator of each span's log-ratio log pi(span) - log nu(span), credited to the
    span's tokens (`last`: all on its last token; `even`: split), on the graph of `log_prob`
    through the span sum, so that a direct loss trains every token of the span."""
    student = span_sums(log_prob, spans.student_span, spans.teacher_log_prob.shape[1])  # (B, S)
    per_span = kl_estimate(student, spans.teacher_log_prob.to(log_prob.dtype), mode)  # (B, S)
    return credit_to_tokens(per_span, spans.student_span, spans.credit)


def _nonzero(n: Number) -> Number:
    # An all-padding mini-batch has zero tokens/rows; its masked sum is 0 too, so dividing by 1 gives
    # a zero loss (with zero gradient) where verl would produce NaN.
    if isinstance(n, torch.Tensor):
        return n.clamp_min(1)
    return n if n else 1


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    batch_num_tokens: Number | None,
    global_batch_size: Number | None,
    loss_scale_factor: Number | None = None,
) -> torch.Tensor:
    """Masked aggregation of a (B, T) per-token loss into a scalar, with explicit normalisers.

    batch_num_tokens: masked-token count of the whole mini-batch (None: this call's mask sum).
    global_batch_size: rows of the whole mini-batch with >= 1 response token (None: this call's).
    loss_scale_factor: divisor for seq-mean-token-sum-norm (None: loss_mask.shape[-1], i.e. T).
    Passing the whole mini-batch's values to every micro-batch makes chunk losses sum to the
    mini-batch loss, since every mode is a sum over rows divided by a batch-level constant.

    verl's agg_loss also multiplies by dp_size (data-parallel ranks), because DDP/FSDP average the
    ranks' gradients; on one device dp_size is 1 and that factor is gone. token-sum (verl v0.9) is
    then the plain masked sum of this call: over the micro-batches of an update the gradients add up
    to that of the sum over every response token of the mini-batch, which is what verl's
    `local sum x dp_size`, averaged over the ranks, gives too. It reads no normaliser.
    """
    mask = loss_mask.bool()  # (B, T)
    # torch.where rather than multiplication: a NaN/inf at a padded position must not leak in.
    masked = torch.where(mask, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    if loss_agg_mode == "token-sum":
        return masked.sum()  # x dp_size = 1; not normalised: the loss grows with the batch's tokens
    if loss_agg_mode == "token-mean":
        n_tokens = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return masked.sum() / _nonzero(n_tokens)
    row_tokens = mask.sum(dim=-1)  # (B,)
    n_rows = (row_tokens > 0).sum() if global_batch_size is None else global_batch_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = masked.sum() / _nonzero(n_rows)  # mean over rows of each row's token sum
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        row_mean = masked.sum(dim=-1) / (row_tokens.to(loss_mat.dtype) + _VERL_EPS)  # (B,) 0 for empty rows
        return row_mean.sum() / _nonzero(n_rows)
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's masked mean (0-dim): sum over mask / (count + 1e-8); 0 when the mask is empty."""
    mask = mask.bool()
    total = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum()
    return total / (mask.sum().to(values.dtype) + _VERL_EPS)


def ppo_clip_losses(
    log_prob: torch.Tensor,  # (B, T) current policy, carries the gradient
    old_log_prob: torch.Tensor,  # (B, T) policy that sampled the tokens
    advantages: torch.Tensor,  # (B, T) detached
    response_mask: torch.Tensor,  # (B, T)
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's vanilla PPO per-token surrogate (dual-clip) and its token-mean diagnostics
    (pg_clipfrac, ppo_kl, pg_clipfrac_lower, unprefixed: the caller says whose)."""
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # bounded for exp stability
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pessimistic = torch.maximum(unclipped, clipped)  # standard PPO: the worse of the two
    # Dual clip: for negative advantages cap the loss at -A * c so a huge ratio cannot dominate.
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    per_token = torch.where(negative, torch.minimum(dual_bound, pessimistic), pessimistic)  # (B, T)
    with torch.no_grad():
        stats = {
            "pg_clipfrac": masked_mean((clipped > unclipped).to(log_prob.dtype), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
            "pg_clipfrac_lower": masked_mean(((pessimistic > dual_bound) & negative).to(log_prob.dtype), response_mask),
        }
    return per_token, {k: float(v) for k, v in stats.items()}


def masked_range(values: torch.Tensor, mask: torch.Tensor, prefix: str) -> dict[str, float]:
    """min/max of values over masked tokens (NaN when there is none, so combine_metrics skips it)."""
    picked = values.detach()[mask]
    if picked.numel() == 0:
        return {f"{prefix}_min": math.nan, f"{prefix}_max": math.nan}
    return {f"{prefix}_min": float(picked.min()), f"{prefix}_max": float(picked.max())}


def per_token_estimate(
    est: EstimatorConfig,
    log_prob: torch.Tensor,  # (B, T)
    teacher_log_prob: torch.Tensor | None,  # (B, T); not read with spans
    spans: Spans | None,
) -> torch.Tensor:
    """est.loss_mode's estimate at each token (B, T): from the teacher's log-probs of the sampled
    tokens, or from its span targets (a teacher of another tokenizer)."""
    if spans is None:
        return kl_estimate(log_prob, teacher_log_prob.to(log_prob.dtype), est.loss_mode)
    return span_kl_estimate(log_prob, spans, est.loss_mode)


def clamped(est: EstimatorConfig, per_token_loss: torch.Tensor) -> torch.Tensor:
    """The per-token loss clamped to +-est.loss_max_clamp (null: as it is)."""
    if est.loss_max_clamp is None:
        return per_token_loss
    # Both sides: k1 is signed, and a large negative value is as destabilising as a large positive.
    return per_token_loss.clamp(min=-est.loss_max_clamp, max=est.loss_max_clamp)


def finish_loss(
    est: EstimatorConfig,
    per_token_loss: torch.Tensor,  # (B, T) distillation loss before loss_max_clamp
    response_mask: torch.Tensor,  # (B, T)
    metrics: dict[str, float],
    *,
    log_prob: torch.Tensor | None,
    old_log_prob: torch.Tensor | None,
    batch_num_tokens: Number | None,
    global_batch_size: Number | None,
    loss_scale_factor: Number | None,
    advantage_mask: torch.Tensor | None = None,
    baseline: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Common tail of both loss families, as verl's `distillation_loss`.

    response_mask: the tokens the loss trains on. advantage_mask: the tokens the discounted
    advantage (kl_discount_factor > 0) sums over, default response_mask; token selection trains on
    a subset of the response while the future KL of a kept token runs over the whole response.
    baseline: subtracted from the per-token loss in the advantage (`distillation_baseline`)."""
    mask = response_mask.bool()
    metrics.update(masked_range(per_token_loss, mask, "distillation/loss"))  # before the clamp, as verl
    per_token_loss = clamped(est, per_token_loss)
    norms = dict(
        batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor
    )
    if est.use_policy_gradient:
        if log_prob is None:
            raise ValueError("use_policy_gradient=true needs log_prob of the sampled tokens")
        if old_log_prob is None:
            old_log_prob = log_prob.detach()  # strictly on-policy: ratio 1
        # The negative distillation loss is the per-token reward/advantage (Thinking Machines' OPD),
        # discounted over the future tokens of the response with kl_discount_factor > 0.
        advantages = policy_gradient_advantages(
            est, per_token_loss.detach(), mask if advantage_mask is None else advantage_mask, baseline
        )
        pg_losses, pg_metrics = ppo_clip_losses(
            log_prob,
            old_log_prob,
            advantages,
            mask,
            clip_ratio_low=est.clip_ratio_low,  # numbers (float fields: null is refused), clip_ratio_c > 1 (checked)
            clip_ratio_high=est.clip_ratio_high,
            clip_ratio_c=est.clip_ratio_c,
        )
        metrics.update({f"distillation/{k}": v for k, v in pg_metrics.items()})
        # not in verl: only where the advantage is not -d (the setting, not the value: a baseline of 0.0 logs too)
        if est.kl_discount_factor or est.advantage_baseline != "none":
            n = int(mask.sum())  # a plain token mean, as distillation/abs_loss
            total = float(torch.where(mask, advantages, advantages.new_zeros(())).sum())
            metrics["distillation/advantage_mean"] = total / n if n else 0.0
        loss = agg_loss(pg_losses, mask, est.loss_agg_mode, **norms)
    else:
        # Supervised (GKD-style): backpropagate the per-token loss itself.
        loss = agg_loss(per_token_loss, mask, est.loss_agg_mode, **norms)
    return loss, per_token_loss, metrics


# --------------------------------------------------------------------------------------------------
# Single-sample estimators
# --------------------------------------------------------------------------------------------------


def distillation_loss(
    est: EstimatorConfig,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor | None,
    teacher_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    batch_num_tokens: Number | None,
    global_batch_size: Number | None,
    loss_scale_factor: Number | None = None,
    advantage_mask: torch.Tensor | None = None,
    baseline: float = 0.0,
    spans: Spans | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Estimator-based distillation loss for one (micro-)batch.

    log_prob: (B, T) current student log-probs of the sampled tokens (the tensor with the gradient).
    old_log_prob: (B, T) log-probs at sampling time, for the PPO ratio (None: log_prob.detach()).
    teacher_log_prob: (B, T); response_mask: (B, T) 0/1, the tokens the loss trains on.
    advantage_mask: (B, T) the response tokens the discounted advantage sums over (None:
    response_mask); only read with policy gradient and est.kl_discount_factor > 0, where the
    advantage of token t is -sum_{s>=t} gamma^(s-t) d_s (d after loss_max_clamp) instead of -d_t.
    baseline: with policy gradient, subtracted from d in the advantage (`distillation_baseline`).
    spans: a teacher with another tokenizer: d is the span estimate credited to the span's tokens
    (`span_kl_estimate`; teacher_log_prob is then not read) and response_mask must leave out the
    unaligned tokens (Batch.scored_mask).
    Returns (loss scalar, per-token loss (B, T) after the clamp, metrics as floats).
    Metrics: distillation/abs_loss, loss_min, loss_max (pre-clamp, over masked tokens) and with
    policy gradient distillation/pg_clipfrac, ppo_kl, pg_clipfrac_lower (and advantage_mean, the
    token mean of the advantage, when it is discounted or has a baseline).
    """
    if est.loss_mode not in ESTIMATOR_MODES:
        raise ValueError(
            f"distillation_loss handles the single-sample estimators {', '.join(ESTIMATOR_MODES)}; "
            f"loss_mode={est.loss_mode!r} needs forward_kl_topk (student logits + teacher top-k)"
        )
    mask = response_mask.bool()  # (B, T)
    # The estimator uses the CURRENT log-probs, so in the direct path its gradient drives the update.
    per_token = per_token_estimate(est, log_prob, teacher_log_prob, spans)  # (B, T)
    with torch.no_grad():
        # Mean |loss| rather than mean loss, because k1 is signed; no eps: a plain mean, as verl.
        abs_sum = torch.where(mask, per_token.abs(), torch.zeros((), dtype=per_token.dtype, device=per_token.device))
        n = int(mask.sum())
        metrics = {"distillation/abs_loss": float(abs_sum.sum()) / n if n else 0.0}
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
        advantage_mask=advantage_mask,
        baseline=baseline,
    )


def distillation_baseline(
    est: EstimatorConfig,
    old_log_prob: torch.Tensor,  # (B, T) log-probs of the policy that sampled the tokens
    teacher_log_prob: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
    spans: Spans | None = None,
) -> float:
    """The baseline of est.advantage_baseline: 0.0 with none; with batch_mean the token mean over
    `response_mask` of the per-token estimate (after loss_max_clamp) under the sampling policy, one
    number for the whole update (tinker-cookbook's RL KL penalty subtracts the same mean). Taken from
    the sampling policy's log-probs, not the update's forward, so that it is known before the first
    chunk's backward; on-policy the two are the same policy."""
    if est.advantage_baseline == "none":
        return 0.0
    estimate = clamped(est, per_token_estimate(est, old_log_prob, teacher_log_prob, spans))  # (B, T)
    mask = response_mask.bool()
    return float(estimate[mask].mean()) if mask.any() else 0.0


# --------------------------------------------------------------------------------------------------
# Micro-batch bookkeeping
# --------------------------------------------------------------------------------------------------


def batch_normalisers(response_mask: torch.Tensor) -> dict[str, float | int]:
    """batch_num_tokens and global_batch_size of a whole mini-batch, to pass to every chunk: each
    chunk's loss is normalised by the mini-batch's counts, so that the chunk losses sum to it."""
    mask = response_mask.bool()  # (B, T)
    return {"batch_num_tokens": float(mask.sum()), "global_batch_size": int((mask.sum(-1) > 0).sum())}


def combine_metrics(parts: Iterable[tuple[dict[str, float], Number]]) -> dict[str, float]:
    """Merge per-micro-batch metrics into the values one call over the whole mini-batch returns.

    parts: (metrics, n_tokens) per chunk, n_tokens = that chunk's masked token count.
    Token means are weighted by n_tokens; *_min/*_max take min/max (ignoring chunks without tokens);
    distillation/loss (if present) is summed; overlap_token_advantage is weighted by its overlapping
    positions (n_tokens * overlap_position_frac). verl instead averages micro-batch values unweighted.
    """
    parts = [(m, float(n)) for m, n in parts]
    keys: list[str] = []
    for metrics, _ in parts:
        keys += [key for key in metrics if key not in keys]
    out: dict[str, float] = {}
    for key in keys:
        present = [(float(m[key]), n, m) for m, n in parts if key in m]
        if key in MIN_METRICS or key in MAX_METRICS:
            vals = [v for v, _, _ in present if not math.isnan(v)]
            out[key] = (min(vals) if key in MIN_METRICS else max(vals)) if vals else math.nan
        elif key in SUM_METRICS:
            out[key] = sum(v for v, _, _ in present)
        else:
            if key in SUBSET_MEAN_METRICS:
                frac_key = SUBSET_MEAN_METRICS[key]
                weighted = [(v, round(n * float(m.get(frac_key, 1.0)))) for v, n, m in present]
            else:
                weighted = [(v, n) for v, n, _ in present]
            total = sum(w for _, w in weighted)
            out[key] = sum(v * w for v, w in weighted) / total if total else 0.0
    return out
