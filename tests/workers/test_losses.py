"""Properties of miniverl.losses beyond the golden vectors: micro-batch invariance above all."""

from __future__ import annotations

import math

import pytest
import torch

from miniverl.bench.loss_memory import chunked_topk_peaks
from miniverl.config.estimator import EstimatorConfig
from miniverl.workers.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    batch_normalisers,
    combine_metrics,
    distillation_loss,
    kl_estimate,
)
from miniverl.workers.topk_loss import chunked_topk_log_probs, forward_kl_topk

B, T, V, K = 8, 6, 13, 4


def _mask() -> torch.Tensor:
    # Ragged rows; rows 6 and 7 are empty, so a 4-way split has a chunk without any token.
    lengths = [6, 3, 1, 5, 2, 4, 0, 0]
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float64)  # (B, T)


def _estimator_inputs():
    g = torch.Generator().manual_seed(0)
    log_prob = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4  # (B, T)
    # Wide old/current gaps so the PPO clip and the dual clip both trigger.
    old_log_prob = log_prob + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6
    teacher_log_prob = -torch.rand(B, T, generator=g, dtype=torch.float64) * 5
    # A few tokens the student now likes far more than at sampling time (ratio e^2 > clip_ratio_c)
    # and more than the teacher (k1 > 0, advantage < 0): the dual clip applies there.
    old_log_prob[:4, 0] = log_prob[:4, 0] - 2.0
    teacher_log_prob[:4, 0] = log_prob[:4, 0] - 1.0
    return log_prob, old_log_prob, teacher_log_prob


def _topk_inputs():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2  # (B, T, V)
    teacher = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2, dim=-1)
    t_lp, t_ids = teacher.topk(K, dim=-1)  # (B, T, K)
    return logits, t_lp, t_ids


def _chunks(n: int):
    size = B // n
    return [slice(i, i + size) for i in range(0, B, size)]


def _assert_metrics_equal(combined: dict, single: dict):
    assert combined.keys() == single.keys()
    for key, value in single.items():
        assert math.isclose(combined[key], value, rel_tol=1e-8, abs_tol=1e-12), (key, combined[key], value)


def _run_estimator_chunks(est, n_chunks, mask):
    log_prob, old_log_prob, teacher = _estimator_inputs()
    log_prob.requires_grad_(True)
    norms = dict(batch_normalisers(mask), loss_scale_factor=T)
    total, parts = 0.0, []
    for rows in _chunks(n_chunks):
        loss, _, metrics = distillation_loss(
            est, log_prob[rows], old_log_prob[rows], teacher[rows], mask[rows], **norms
        )
        loss.backward()
        total = total + loss.detach()
        parts.append((metrics, mask[rows].sum()))
    return total, log_prob.grad, combine_metrics(parts)


ESTIMATORS = {
    "pg-k1": dict(
        loss_mode="k1", use_policy_gradient=True, loss_max_clamp=1.5, clip_ratio_low=0.1, clip_ratio_high=0.28
    ),
    "direct-k3": dict(loss_mode="k3", use_policy_gradient=False, loss_max_clamp=0.5),
}


@pytest.mark.parametrize("n_chunks", [2, 4])
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimator_loss_and_grad_of_a_mini_batch_equal_the_sum_over_row_chunks(name, loss_agg_mode, n_chunks):
    est = EstimatorConfig(**ESTIMATORS[name], loss_agg_mode=loss_agg_mode)
    mask = _mask()
    whole_loss, whole_grad, whole_metrics = _run_estimator_chunks(est, 1, mask)
    chunk_loss, chunk_grad, chunk_metrics = _run_estimator_chunks(est, n_chunks, mask)
    torch.testing.assert_close(chunk_loss, whole_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(chunk_grad, whole_grad, rtol=1e-12, atol=1e-14)
    _assert_metrics_equal(chunk_metrics, whole_metrics)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_one_chunk_with_explicit_normalisers_equals_a_call_with_local_normalisers(name):
    est = EstimatorConfig(**ESTIMATORS[name], loss_agg_mode="seq-mean-token-mean")
    log_prob, old_log_prob, teacher = _estimator_inputs()
    mask = _mask()
    explicit, _, _ = distillation_loss(est, log_prob, old_log_prob, teacher, mask, **batch_normalisers(mask))
    local, _, _ = distillation_loss(
        est, log_prob, old_log_prob, teacher, mask, batch_num_tokens=None, global_batch_size=None
    )
    torch.testing.assert_close(explicit, local, rtol=0, atol=0)


def test_pg_mini_batch_exercises_clipping_and_dual_clip():
    # Guards the invariance test above against a vacuous PG case.
    est = EstimatorConfig(**ESTIMATORS["pg-k1"])
    _, _, metrics = _run_estimator_chunks(est, 1, _mask())
    assert metrics["distillation/pg_clipfrac"] > 0 and metrics["distillation/pg_clipfrac_lower"] > 0


def _run_topk_chunks(est, n_chunks, mask):
    logits, t_lp, t_ids = _topk_inputs()
    logits.requires_grad_(True)
    norms = dict(batch_normalisers(mask), loss_scale_factor=T)
    total, parts = 0.0, []
    for rows in _chunks(n_chunks):
        loss, _, metrics = forward_kl_topk(est, logits[rows], t_lp[rows], t_ids[rows], mask[rows], **norms)
        loss.backward()
        total = total + loss.detach()
        parts.append((metrics, mask[rows].sum()))
    return total, logits.grad, combine_metrics(parts)


@pytest.mark.parametrize("n_chunks", [2, 4])
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_forward_kl_topk_loss_and_grad_of_a_mini_batch_equal_the_sum_over_row_chunks(loss_agg_mode, n_chunks):
    est = EstimatorConfig(loss_mode="forward_kl_topk", topk=K, log_prob_min_clamp=-6.0, loss_agg_mode=loss_agg_mode)
    mask = _mask()
    whole_loss, whole_grad, whole_metrics = _run_topk_chunks(est, 1, mask)
    chunk_loss, chunk_grad, chunk_metrics = _run_topk_chunks(est, n_chunks, mask)
    torch.testing.assert_close(chunk_loss, whole_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(chunk_grad, whole_grad, rtol=1e-12, atol=1e-14)
    _assert_metrics_equal(chunk_metrics, whole_metrics)
    # The overlap metric is a mean over a subset of positions; make sure that subset is non-trivial.
    assert 0 < whole_metrics["distillation/overlap_position_frac"] < 1


def test_combine_metrics_takes_min_and_max_and_ignores_chunks_without_tokens():
    parts = [
        ({"distillation/loss_min": 0.5, "distillation/loss_max": 2.0, "distillation/abs_loss": 1.0}, 3),
        ({"distillation/loss_min": math.nan, "distillation/loss_max": math.nan, "distillation/abs_loss": 0.0}, 0),
        ({"distillation/loss_min": 0.2, "distillation/loss_max": 1.0, "distillation/abs_loss": 4.0}, 1),
    ]
    assert combine_metrics(parts) == {
        "distillation/loss_min": 0.2,
        "distillation/loss_max": 2.0,
        "distillation/abs_loss": (3 * 1.0 + 4.0) / 4,
    }


def test_agg_loss_modes_on_a_hand_computed_example():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.float64)
    kw = dict(batch_num_tokens=None, global_batch_size=None)
    assert agg_loss(loss, mask, "token-mean", **kw).item() == pytest.approx(7 / 3)
    assert agg_loss(loss, mask, "seq-mean-token-sum", **kw).item() == pytest.approx((3 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", **kw).item() == pytest.approx((3 + 4) / 2 / 3)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", **kw, loss_scale_factor=7).item() == pytest.approx(0.5)
    assert agg_loss(loss, mask, "seq-mean-token-mean", **kw).item() == pytest.approx((1.5 + 4) / 2)
    # Global normalisers replace the local ones.
    assert agg_loss(loss, mask, "token-mean", batch_num_tokens=6, global_batch_size=None).item() == pytest.approx(7 / 6)


def test_all_padding_batch_gives_zero_loss_not_nan():
    est = EstimatorConfig(loss_mode="k3", loss_agg_mode="token-mean")
    log_prob = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 3)
    loss, _, metrics = distillation_loss(est, log_prob, None, log_prob.detach() - 1, mask, **batch_normalisers(mask))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(log_prob.grad == 0)
    assert math.isnan(metrics["distillation/loss_min"]) and metrics["distillation/abs_loss"] == 0.0


def test_estimators_follow_verl_formulas_and_low_var_kl_is_clamped_at_10():
    lp = torch.tensor([-1.0, -2.0, -30.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -1.0], dtype=torch.float64)
    d = lp - ref
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), d)
    torch.testing.assert_close(kl_estimate(lp, ref, "abs"), d.abs())
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), 0.5 * d**2)
    k3 = kl_estimate(lp, ref, "low_var_kl")
    torch.testing.assert_close(k3[:2], torch.exp(-d[:2]) + d[:2] - 1)
    assert k3[2].item() == 10.0  # exp(20)-20-1 after the +-20 log-ratio clamp, then capped at 10
    with pytest.raises(ValueError, match="k3\\+"):
        kl_estimate(lp, ref, "k3+")


def test_pg_without_old_log_prob_is_strictly_on_policy():
    est = EstimatorConfig(loss_mode="k1", use_policy_gradient=True)
    log_prob, _, teacher = _estimator_inputs()
    mask = _mask()
    loss, per_token, metrics = distillation_loss(est, log_prob, None, teacher, mask, **batch_normalisers(mask))
    assert metrics["distillation/ppo_kl"] == 0.0 and metrics["distillation/pg_clipfrac"] == 0.0
    # ratio == 1, so the surrogate's value is the mean advantage's negative: the mean k1 itself.
    torch.testing.assert_close(loss, per_token[mask.bool()].mean())


def test_distillation_loss_points_forward_kl_topk_to_its_own_function():
    est = EstimatorConfig(loss_mode="forward_kl_topk", topk=K)
    log_prob, old_log_prob, teacher = _estimator_inputs()
    with pytest.raises(ValueError, match="forward_kl_topk"):
        distillation_loss(est, log_prob, old_log_prob, teacher, _mask(), batch_num_tokens=None, global_batch_size=None)


def test_forward_kl_topk_accepts_bf16_logits_and_computes_in_float32():
    logits, t_lp, t_ids = _topk_inputs()
    est = EstimatorConfig(loss_mode="forward_kl_topk", topk=K)
    mask = _mask()
    loss, per_token, _ = forward_kl_topk(
        est, logits.to(torch.bfloat16), t_lp.float(), t_ids, mask, **batch_normalisers(mask)
    )
    assert per_token.dtype == torch.float32 and torch.isfinite(loss)
    ref, _, _ = forward_kl_topk(est, logits, t_lp, t_ids, mask, **batch_normalisers(mask))
    assert loss.item() == pytest.approx(ref.item(), rel=0.05)


def test_forward_kl_topk_with_policy_gradient_uses_the_topk_loss_as_advantage():
    with pytest.warns(UserWarning):
        est = EstimatorConfig(loss_mode="forward_kl_topk", topk=K, use_policy_gradient=True)
    logits, t_lp, t_ids = _topk_inputs()
    log_prob = torch.log_softmax(logits, -1)[..., 0].clone().requires_grad_(True)  # (B, T) "sampled" token 0
    mask = _mask()
    loss, per_token, metrics = forward_kl_topk(
        est, logits, t_lp, t_ids, mask, **batch_normalisers(mask), log_prob=log_prob
    )
    loss.backward()
    # On-policy ratio 1 and token-mean: loss = mean(per-token loss); gradient only via log_prob.
    torch.testing.assert_close(loss, per_token[mask.bool()].mean())
    torch.testing.assert_close(log_prob.grad, per_token.detach() * mask / mask.sum())
    assert "distillation/pg_clipfrac" in metrics


# --------------------------------------------------------------------------------------------------
# token-sum (verl v0.9's agg_loss mode)
# --------------------------------------------------------------------------------------------------


def test_token_sum_is_the_masked_sum_and_reads_no_normaliser():
    loss = torch.tensor([[1.0, 2.0, math.nan], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.float64)
    for norms in (
        dict(batch_num_tokens=None, global_batch_size=None),
        dict(batch_num_tokens=6, global_batch_size=5, loss_scale_factor=7),
    ):
        assert agg_loss(loss, mask, "token-sum", **norms).item() == 1 + 2 + 4  # NaN under the mask is ignored


def _verl_agg_loss(loss, mask, mode, *, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    """verl's agg_loss formulas with their dp_size factor (core_algos.agg_loss, v0.9.1), for the test below."""
    masked = torch.where(mask.bool(), loss, 0.0)
    if mode == "token-sum":
        return masked.sum() * dp_size
    if mode == "token-mean":
        return masked.sum() / batch_num_tokens * dp_size
    rows = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        rows = rows / (mask.sum(-1) + 1e-8)
    out = rows.sum() / global_batch_size * dp_size
    return out / loss_scale_factor if mode == "seq-mean-token-sum-norm" else out


@pytest.mark.parametrize("dp_size", [2, 4])
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_one_device_loss_equals_verls_data_parallel_loss_averaged_over_its_ranks(loss_agg_mode, dp_size):
    # DDP/FSDP average the ranks' gradients; verl multiplies each rank's loss by dp_size so that the
    # average is the global batch's loss. miniverl on one device computes that global loss directly.
    g = torch.Generator().manual_seed(3)
    loss = torch.randn(B, T, generator=g, dtype=torch.float64, requires_grad=True)
    mask = _mask()
    global_norms = dict(batch_normalisers(mask), loss_scale_factor=T)
    ranks = [
        _verl_agg_loss(loss[rows], mask[rows], loss_agg_mode, dp_size=dp_size, **global_norms)
        for rows in _chunks(dp_size)
    ]
    (verl_grad,) = torch.autograd.grad(sum(ranks) / dp_size, loss)
    ours = agg_loss(loss, mask, loss_agg_mode, **global_norms)
    (our_grad,) = torch.autograd.grad(ours, loss)
    torch.testing.assert_close(ours, sum(ranks).detach() / dp_size, rtol=1e-13, atol=0)
    torch.testing.assert_close(our_grad, verl_grad, rtol=1e-13, atol=0)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_token_sum_is_token_mean_times_the_mini_batch_token_count(name):
    mask = _mask()
    n_tokens = mask.sum()
    losses = {}
    for mode in ("token-sum", "token-mean"):
        est = EstimatorConfig(**ESTIMATORS[name], loss_agg_mode=mode)
        losses[mode] = _run_estimator_chunks(est, 4, mask)
    torch.testing.assert_close(losses["token-sum"][0], losses["token-mean"][0] * n_tokens, rtol=1e-12, atol=0)
    torch.testing.assert_close(losses["token-sum"][1], losses["token-mean"][1] * n_tokens, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------------------------------
# Chunked top-k (estimator.use_chunked_topk, verl v0.9)
# --------------------------------------------------------------------------------------------------


def _topk_loss_and_grad(est, logits, t_lp, t_ids, mask):
    logits = logits.detach().clone().requires_grad_(True)
    loss, per_token, metrics = forward_kl_topk(est, logits, t_lp, t_ids, mask, **batch_normalisers(mask))
    loss.backward()
    return loss.detach(), per_token.detach(), metrics, logits.grad


@pytest.mark.parametrize("chunk", [1, 5, 7, 16, B * T, 4096])  # B*T = 48: 5 and 7 do not divide it
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "token-sum"])
def test_chunked_topk_gives_the_unchunked_loss_gradient_and_metrics_in_float64(chunk, loss_agg_mode):
    logits, t_lp, t_ids = _topk_inputs()
    mask = _mask()
    common = dict(loss_mode="forward_kl_topk", topk=K, log_prob_min_clamp=-6.0, loss_agg_mode=loss_agg_mode)
    whole = _topk_loss_and_grad(EstimatorConfig(**common), logits, t_lp, t_ids, mask)
    est = EstimatorConfig(**common, use_chunked_topk=True, chunked_topk_chunk_size=chunk)
    chunked = _topk_loss_and_grad(est, logits, t_lp, t_ids, mask)
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-12, atol=1e-14)  # loss
    torch.testing.assert_close(chunked[1], whole[1], rtol=1e-12, atol=1e-14)  # per-token loss
    torch.testing.assert_close(chunked[3], whole[3], rtol=1e-12, atol=1e-14)  # d loss / d logits
    _assert_metrics_equal(chunked[2], whole[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_topk_matches_the_unchunked_path_for_strided_and_half_precision_logits(dtype):
    logits, t_lp, t_ids = _topk_inputs()
    padded = torch.cat([logits, logits[:, :2]], dim=1).to(dtype)  # (B, T+2, V)
    mask = _mask()
    common = dict(loss_mode="forward_kl_topk", topk=K, log_prob_min_clamp=-6.0)
    results = []
    for est in (EstimatorConfig(**common), EstimatorConfig(**common, use_chunked_topk=True, chunked_topk_chunk_size=5)):
        leaf = padded.clone().requires_grad_(True)
        strided = leaf[:, 1 : T + 1]  # not contiguous: chunks span rows of a strided view
        loss, per_token, _ = forward_kl_topk(est, strided, t_lp.float(), t_ids, mask, **batch_normalisers(mask))
        loss.backward()
        results.append((loss.detach(), per_token.detach(), leaf.grad))
    (loss0, tok0, grad0), (loss1, tok1, grad1) = results
    assert tok1.dtype == torch.float32 and grad1.dtype == dtype
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(tok1, tok0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad1.float(), grad0.float(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_topk_never_holds_a_full_float_log_softmax_in_forward_or_backward(dtype):
    """N = 64 positions, V = 4096: one (N, V) float32 tensor is 1 MiB (`python -m miniverl.bench
    --losses` measures the same at its vocabulary)."""
    chunk = 4
    peaks = chunked_topk_peaks(b=4, t=16, vocab=4096, k=8, chunk=chunk, dtype=dtype)
    gradient, full_float = peaks["logits_gradient"], peaks["full_float32_tensor"]
    chunk_float = peaks["chunk_float32_tensor"]
    assert chunk_float == chunk * 4096 * 4 and gradient == 64 * 4096 * (4 if dtype == torch.float32 else 2)
    # Chunked: the gradient plus a few (chunk, V) float32 buffers, never another (B, T, V) one.
    assert peaks["chunked"] <= gradient + 8 * chunk_float, (peaks, gradient, chunk_float)
    assert peaks["chunked"] < gradient + full_float
    # The measurement bites: the unchunked path holds full-size float buffers beside the gradient.
    assert peaks["unchunked"] >= gradient + full_float, (peaks, gradient, full_float)


def test_chunked_topk_of_no_positions_has_an_empty_gradient():
    """A micro-batch of padding only (verl handles it too): forward and backward of zero positions."""
    logits = torch.randn(2, 0, 10, dtype=torch.float64, requires_grad=True)  # (B, T=0, V)
    log_probs, _ = chunked_topk_log_probs(logits, torch.zeros(2, 0, 3, dtype=torch.long), 4)
    log_probs.sum().backward()
    assert log_probs.shape == (2, 0, 3) and logits.grad.shape == (2, 0, 10)
