"""forward_kl_topk_tail (verl RFC #7856 / PR #7855): the top-k forward KL plus one tail bucket per distribution,

    loss_t = sum_{i in K} p_i (log p_i - log q_i) + (1 - P_K) (log(1 - P_K) - log(1 - Q_K)),

p the teacher, q the student, K the teacher's top-k ids, P_K = sum_K p_i, Q_K = sum_K q_i. Checked against
hand-derived numbers and an independent float64 reference written from the formula in plain probabilities.
"""

from __future__ import annotations

import math

import pytest
import torch

from miniverl.config.estimator import EstimatorConfig
from miniverl.workers.losses import LOSS_AGG_MODES, batch_normalisers, combine_metrics
from miniverl.workers.topk_loss import (
    TopkTerms,
    forward_kl_topk,
    forward_kl_topk_terms,
    tail_bucket_kl,
    topk_distillation_loss,
)

B, T, V, K = 8, 6, 13, 4
F64 = torch.float64


def _tail_est(k: int = K, **kw) -> EstimatorConfig:
    return EstimatorConfig(loss_mode="forward_kl_topk_tail", topk=k, use_policy_gradient=False, **kw)


def _reference(logits: torch.Tensor, t_lp: torch.Tensor, t_ids: torch.Tensor) -> torch.Tensor:
    """The formula in plain float64 probabilities (no log-space tricks), per position: (...)."""
    q = torch.softmax(logits.to(F64), dim=-1)  # (..., V)
    q_k = q.gather(-1, t_ids)  # (..., k)
    p_k = t_lp.to(F64).exp()  # (..., k)
    p_tail, q_tail = 1 - p_k.sum(-1), 1 - q_k.sum(-1)
    return (p_k * (p_k.log() - q_k.log())).sum(-1) + p_tail * (p_tail.log() - q_tail.log())


def _per_token(est, logits, t_lp, t_ids, mask=None):
    mask = torch.ones(logits.shape[:2], dtype=F64) if mask is None else mask
    return forward_kl_topk(est, logits, t_lp, t_ids, mask, **batch_normalisers(mask))


def _hand_case(student: tuple[float, ...]):
    """V = 4, k = 2; teacher p = (0.5, 0.3, 0.15, 0.05), so K = {0, 1}, P_K = 0.8, teacher tail 0.2."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=F64)
    t_lp, t_ids = p.log().topk(2)
    logits = torch.tensor(student, dtype=F64).log()  # softmax(log q) = q
    return logits.view(1, 1, 4).requires_grad_(True), t_lp.view(1, 1, 2), t_ids.view(1, 1, 2)


# Gradient by hand: with q = softmax(z), d(-log q_i)/dz_j = q_j - [i = j] and dQ_K/dz_j = q_j [j in K] - Q_K q_j, so
#   dloss/dz_j = q_j - p_j                        for j in K,
#   dloss/dz_j = q_j (P_K - Q_K) / (1 - Q_K)      for j outside K.
HAND_CASES = {
    # q = (0.4, 0.2, 0.3, 0.1): Q_K = 0.6, student tail 0.4.
    #   0.5 ln(0.5/0.4) + 0.3 ln(0.3/0.2) + 0.2 ln(0.2/0.4)
    #   = 0.111571776 + 0.121639532 - 0.138629436 = 0.094581872
    # gradient: K: (0.4 - 0.5, 0.2 - 0.3) = (-0.1, -0.1); outside: q_j (0.8 - 0.6) / 0.4 = 0.5 q_j = (0.15, 0.05).
    "student-short-of-the-top-k": ((0.4, 0.2, 0.3, 0.1), 0.0945818719775651, (-0.1, -0.1, 0.15, 0.05)),
    # q = (0.6, 0.35, 0.04, 0.01): Q_K = 0.95 > P_K. The top-k sum is negative,
    #   0.5 ln(0.5/0.6) + 0.3 ln(0.3/0.35) = -0.091160778 - 0.046245204 = -0.137405982
    # (forward_kl_topk floors it at 0), the tail bucket 0.2 ln(0.2/0.05) = 0.277258872; total 0.139852890.
    # gradient: K: (0.1, 0.05); outside: q_j (0.8 - 0.95) / 0.05 = -3 q_j = (-0.12, -0.03).
    "student-over-the-top-k": ((0.6, 0.35, 0.04, 0.01), 0.13985288987882333, (0.1, 0.05, -0.12, -0.03)),
}


@pytest.mark.parametrize("name", HAND_CASES)
def test_hand_derived_loss_and_gradient(name):
    student, expected, expected_grad = HAND_CASES[name]
    logits, t_lp, t_ids = _hand_case(student)
    loss, per_token, _ = _per_token(_tail_est(k=2), logits, t_lp, t_ids)
    loss.backward()
    assert per_token.item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-15)  # one token: token-mean is the token
    torch.testing.assert_close(logits.grad.view(4), torch.tensor(expected_grad, dtype=F64), rtol=1e-12, atol=1e-14)
    assert _reference(logits.detach(), t_lp, t_ids).item() == pytest.approx(expected, rel=1e-12)


def _random_inputs(seed: int, b: int = B, t: int = T, v: int = V, k: int = K, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, dtype=F64) * scale  # (b, t, v)
    teacher = torch.log_softmax(torch.randn(b, t, v, generator=g, dtype=F64) * scale, dim=-1)
    t_lp, t_ids = teacher.topk(k, dim=-1)  # (b, t, k)
    return logits, t_lp, t_ids


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_matches_the_float64_reference_and_its_autograd_gradient(chunk_size):
    logits, t_lp, t_ids = _random_inputs(0)
    est = _tail_est(use_chunked_topk=chunk_size is not None, chunked_topk_chunk_size=chunk_size or 4096)
    got_logits = logits.clone().requires_grad_(True)
    _, per_token, _ = _per_token(est, got_logits, t_lp, t_ids)
    per_token.sum().backward()
    ref_logits = logits.clone().requires_grad_(True)
    ref = _reference(ref_logits, t_lp, t_ids)
    ref.sum().backward()
    torch.testing.assert_close(per_token, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_logits.grad, ref_logits.grad, rtol=1e-10, atol=1e-13)


def test_gradcheck_through_the_terms_and_the_tail():
    logits, t_lp, t_ids = _random_inputs(1, b=2, t=3, v=7, k=3)
    est = _tail_est(k=3)

    def f(x):
        terms = forward_kl_topk_terms(x, t_lp, t_ids)
        mask = torch.ones(2, 3, dtype=F64)
        return topk_distillation_loss(est, terms, mask, **batch_normalisers(mask))[1]  # (2, 3) per-token

    assert torch.autograd.gradcheck(f, (logits.requires_grad_(True),), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("scale", [0.5, 2.0, 6.0])
@pytest.mark.parametrize("k", [1, 4, 12])
def test_nonnegative_on_random_inputs(k, scale):
    for seed in range(5):
        logits, t_lp, t_ids = _random_inputs(10 + seed, k=k, scale=scale)
        _, per_token, _ = _per_token(_tail_est(k=k), logits, t_lp, t_ids)
        assert per_token.min() >= -1e-13, per_token.min()  # the sum; either part alone may be < 0


def test_exactly_zero_when_the_student_is_the_teacher():
    logits, _, t_ids = _random_inputs(2)
    # The teacher's top-k log-probs formed exactly as the loss forms the student's: equal bit for bit.
    t_lp = logits.gather(-1, t_ids) - torch.logsumexp(logits, dim=-1, keepdim=True)
    leaf = logits.clone().requires_grad_(True)
    loss, per_token, metrics = _per_token(_tail_est(), leaf, t_lp, t_ids)
    loss.backward()
    assert torch.equal(per_token, torch.zeros_like(per_token))
    assert metrics["distillation/tail_kl"] == 0.0
    torch.testing.assert_close(leaf.grad, torch.zeros_like(leaf.grad), rtol=0, atol=1e-15)
    # The teacher from log_softmax (rounded differently): zero up to rounding.
    t_lp = torch.log_softmax(logits, dim=-1).gather(-1, t_ids)
    _, per_token, _ = _per_token(_tail_est(), logits, t_lp, t_ids)
    torch.testing.assert_close(per_token, torch.zeros_like(per_token), rtol=0, atol=1e-14)


@pytest.mark.parametrize("log_prob_min_clamp", [None, -6.0])
def test_top_k_over_the_whole_vocabulary_is_the_full_forward_kl(log_prob_min_clamp):
    logits, _, _ = _random_inputs(3)
    teacher = torch.log_softmax(torch.randn(B, T, V, generator=torch.Generator().manual_seed(4), dtype=F64), -1)
    t_lp, t_ids = teacher.topk(V, dim=-1)  # K = the vocabulary: both tails are 0 up to rounding
    leaf = logits.clone().requires_grad_(True)
    est = _tail_est(k=V, log_prob_min_clamp=log_prob_min_clamp)
    _, per_token, metrics = _per_token(est, leaf, t_lp, t_ids)
    per_token.sum().backward()
    q = torch.log_softmax(logits, dim=-1)
    full = (teacher.exp() * (teacher - q)).sum(-1)  # (B, T)
    if log_prob_min_clamp is None:
        torch.testing.assert_close(per_token, full, rtol=1e-12, atol=1e-13)
        # d KL(p || softmax z) / dz = q - p
        torch.testing.assert_close(leaf.grad, q.exp() - teacher.exp(), rtol=1e-10, atol=1e-12)
    else:
        # The tail adds nothing: the loss is forward_kl_topk's (floored) sum over the whole vocabulary.
        verl_sum = forward_kl_topk_terms(logits, t_lp, t_ids, log_prob_min_clamp=log_prob_min_clamp).per_token_loss
        torch.testing.assert_close(per_token, verl_sum, rtol=0, atol=1e-13)
    assert abs(metrics["distillation/tail_kl"]) < 1e-13


def test_not_floored_at_zero_where_forward_kl_topk_is():
    logits, t_lp, t_ids = _hand_case(HAND_CASES["student-over-the-top-k"][0])
    verl_loss, verl_per_token, _ = _per_token(EstimatorConfig(loss_mode="forward_kl_topk", topk=2), logits, t_lp, t_ids)
    verl_loss.backward()
    assert verl_per_token.item() == 0.0 and torch.count_nonzero(logits.grad) == 0  # floored: no signal at all
    logits.grad = None
    loss, per_token, _ = _per_token(_tail_est(k=2), logits, t_lp, t_ids)
    loss.backward()
    assert per_token.item() == pytest.approx(0.13985288987882333, rel=1e-12)
    assert logits.grad.abs().min() > 0.01
    # A student sharper than the teacher puts more mass on the teacher's top-k (Q_K > P_K): the truncated sum
    # is negative at many positions, where the tail loss is still > 0.
    _, t_lp, t_ids = _random_inputs(5)
    teacher = torch.log_softmax(torch.randn(B, T, V, generator=torch.Generator().manual_seed(5), dtype=F64) * 2, -1)
    t_lp, t_ids = teacher.topk(K, dim=-1)
    logits = 1.5 * teacher + 0.05 * torch.randn(B, T, V, generator=torch.Generator().manual_seed(6), dtype=F64)
    truncated = forward_kl_topk_terms(logits, t_lp, t_ids).per_token_loss
    _, per_token, _ = _per_token(_tail_est(), logits, t_lp, t_ids)
    assert (truncated < 0).any() and (per_token[truncated < 0] > 0).all()


def test_loss_max_clamp_still_applies():
    logits, t_lp, t_ids = _random_inputs(6, scale=4.0)
    _, unclamped, _ = _per_token(_tail_est(), logits, t_lp, t_ids)
    cap = float(unclamped.median())
    _, clamped, metrics = _per_token(_tail_est(loss_max_clamp=cap), logits, t_lp, t_ids)
    torch.testing.assert_close(clamped, unclamped.clamp(max=cap), rtol=0, atol=0)
    assert metrics["distillation/loss_max"] == pytest.approx(float(unclamped.max()))  # before the clamp, as verl


def test_log_prob_min_clamp_floors_the_top_k_sum_and_leaves_the_tail_unfloored():
    logits, t_lp, t_ids = _random_inputs(7, k=8, scale=4.0)
    clamp = -5.0
    assert (t_lp < clamp).any() and (torch.log_softmax(logits, -1).gather(-1, t_ids) < clamp).any()  # it bites
    _, per_token, _ = _per_token(_tail_est(k=8, log_prob_min_clamp=clamp), logits, t_lp, t_ids)
    q = torch.softmax(logits, dim=-1)
    q_lp, p_lp = q.gather(-1, t_ids).log().clamp_min(clamp), t_lp.clamp_min(clamp)
    head = (p_lp.exp() * (p_lp - q_lp)).sum(-1)  # forward_kl_topk's floored sum
    p_tail, q_tail = 1 - t_lp.exp().sum(-1), 1 - q.gather(-1, t_ids).sum(-1)  # the unfloored masses
    torch.testing.assert_close(per_token, head + p_tail * (p_tail.log() - q_tail.log()), rtol=1e-12, atol=1e-14)


def test_finite_loss_and_gradient_where_a_tail_vanishes_or_a_mass_rounds_past_one():
    logits = torch.zeros(1, 4, 5, dtype=F64)
    logits[0, 0, 2:] = -60.0  # student: the top-k {0, 1} holds all but ~e^-60: log Q_K rounds to 0, tail floored
    logits[0, 1, 2:] = -1e4  # student tail exactly 0 (exp underflows)
    t_ids = torch.tensor([[[0, 1]] * 4])
    t_lp = torch.log(torch.tensor([[[0.7, 0.2]] * 4], dtype=F64))  # teacher tail 0.1
    t_lp[0, 2] = torch.tensor([0.0, -1e4], dtype=F64)  # teacher tail 0: weighs 0 (0 log 0 = 0)
    t_lp[0, 3] = 0.0  # padding-like: masses e^0 + e^0 = 2 > 1 on the teacher's side
    t_ids[0, 3] = 0  # duplicate ids: the student's "mass" 2 q_0 may pass 1
    leaf = logits.requires_grad_(True)
    loss, per_token, _ = _per_token(_tail_est(k=2), leaf, t_lp, t_ids)
    loss.backward()
    assert torch.isfinite(per_token).all() and torch.isfinite(leaf.grad).all()
    eps = torch.finfo(F64).eps
    head = (t_lp[0, 0].exp() * (t_lp[0, 0] - torch.log_softmax(logits.detach()[0, 0], -1)[:2])).sum()
    # Floored student tail: the bucket is 0.1 (log 0.1 - log eps), the bounded stand-in for log(e^-60).
    assert per_token[0, 0].item() == pytest.approx(head.item() + 0.1 * (math.log(0.1) - math.log(eps)), rel=1e-12)
    # Teacher tail 0 against a uniform student (tail 3/5): the bucket weighs 0, the loss is 1 * ln(1 / (1/5)).
    assert per_token[0, 2].item() == pytest.approx(math.log(5), rel=1e-12)
    # Shifted logits round log Q_K to eps |log Z| rather than to 0: a tail below that is noise, and the bucket
    # stays within the floor's bound.
    shifted = logits.detach().clone()
    shifted[0, 0] += 60.0
    _, per_token, _ = _per_token(_tail_est(k=2), shifted, t_lp, t_ids)
    bound = head.item() + 0.1 * (math.log(0.1) - math.log(eps))
    assert head.item() + 0.1 * (math.log(0.1) - math.log(1e-12)) < per_token[0, 0].item() <= bound + 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_half_and_single_precision_logits_are_computed_in_float32_near_the_float64_loss(dtype):
    logits, t_lp, t_ids = _random_inputs(14)
    mask = _mask()
    leaf = logits.to(dtype).requires_grad_(True)
    loss, per_token, _ = forward_kl_topk(_tail_est(), leaf, t_lp.float(), t_ids, mask, **batch_normalisers(mask))
    loss.backward()
    assert per_token.dtype == torch.float32 and torch.isfinite(leaf.grad.float()).all()
    ref = _reference(leaf.detach().to(F64), t_lp.float().to(F64), t_ids)
    torch.testing.assert_close(per_token.to(F64), ref, rtol=1e-5, atol=1e-5)


def test_tail_bucket_kl_alone():
    p_mass = torch.tensor([0.8, 0.8, 1.0, 0.3, 1e-20], dtype=F64)
    q_mass = torch.tensor([0.6, 0.95, 0.5, 1e-18, 1e-20], dtype=F64)
    got = tail_bucket_kl(p_mass.log(), q_mass.log())
    p_tail, q_tail = 1 - p_mass, 1 - q_mass
    want = torch.where(p_tail > 0, p_tail * (p_tail.log() - q_tail.log()), torch.zeros((), dtype=F64))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-300)
    # Tiny masses: log(1 - Q) = log1p(-Q) to full relative precision (-1e-18 + 1e-20 for the fourth).
    assert got[3].item() == pytest.approx(0.7 * (math.log(0.7) + 1e-18), rel=1e-15)


# --------------------------------------------------------------------------------------------------
# Chunking: a mini-batch's loss and gradient are the sum over its row chunks with the mini-batch's normalisers.
# --------------------------------------------------------------------------------------------------


def _mask() -> torch.Tensor:
    # Ragged rows; rows 6 and 7 are empty, so a 4-way split has a chunk without any token.
    lengths = [6, 3, 1, 5, 2, 4, 0, 0]
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(F64)  # (B, T)


def _chunks(n: int):
    size = B // n
    return [slice(i, i + size) for i in range(0, B, size)]


def _run_chunks(est, n_chunks, mask):
    logits, t_lp, t_ids = _random_inputs(8)
    logits.requires_grad_(True)
    norms = dict(batch_normalisers(mask), loss_scale_factor=T)
    total, parts = 0.0, []
    for rows in _chunks(n_chunks):
        loss, _, metrics = forward_kl_topk(est, logits[rows], t_lp[rows], t_ids[rows], mask[rows], **norms)
        loss.backward()
        total = total + loss.detach()
        parts.append((metrics, mask[rows].sum()))
    return total, logits.grad, combine_metrics(parts)


def _assert_metrics_equal(combined: dict, single: dict):
    assert combined.keys() == single.keys()
    for key, value in single.items():
        assert math.isclose(combined[key], value, rel_tol=1e-8, abs_tol=1e-12), (key, combined[key], value)


@pytest.mark.parametrize("n_chunks", [2, 4])
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_loss_and_grad_of_a_mini_batch_equal_the_sum_over_row_chunks(loss_agg_mode, n_chunks):
    est = _tail_est(log_prob_min_clamp=-6.0, loss_max_clamp=3.0, loss_agg_mode=loss_agg_mode)
    mask = _mask()
    whole_loss, whole_grad, whole_metrics = _run_chunks(est, 1, mask)
    chunk_loss, chunk_grad, chunk_metrics = _run_chunks(est, n_chunks, mask)
    torch.testing.assert_close(chunk_loss, whole_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(chunk_grad, whole_grad, rtol=1e-12, atol=1e-14)
    _assert_metrics_equal(chunk_metrics, whole_metrics)
    assert "distillation/tail_kl" in whole_metrics


def test_terms_computed_per_position_chunk_give_the_whole_loss():
    """The actor's path (logprobs.topk_terms): terms per chunk of positions, concatenated, then
    one topk_distillation_loss."""
    logits, t_lp, t_ids = _random_inputs(9)
    mask = _mask()
    est = _tail_est(log_prob_min_clamp=-6.0)
    whole = logits.clone().requires_grad_(True)
    w_loss, w_per_token, w_metrics = forward_kl_topk(est, whole, t_lp, t_ids, mask, **batch_normalisers(mask))
    w_loss.backward()
    parts = logits.clone().requires_grad_(True)
    flat = [x.reshape(B * T, 1, *x.shape[2:]) for x in (parts, t_lp, t_ids)]  # positions as rows of one
    pieces = [forward_kl_topk_terms(*(x[s : s + 7] for x in flat), log_prob_min_clamp=-6.0) for s in range(0, B * T, 7)]
    terms = TopkTerms(*(torch.cat(field).view(B, T) for field in zip(*pieces)))
    loss, per_token, metrics = topk_distillation_loss(est, terms, mask, **batch_normalisers(mask))
    loss.backward()
    torch.testing.assert_close(loss, w_loss, rtol=1e-13, atol=0)
    torch.testing.assert_close(per_token, w_per_token, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(parts.grad, whole.grad, rtol=1e-12, atol=1e-15)
    _assert_metrics_equal(metrics, w_metrics)


@pytest.mark.parametrize("chunk", [1, 5, 4096])
def test_chunked_topk_gives_the_unchunked_tail_loss_and_gradient(chunk):
    logits, t_lp, t_ids = _random_inputs(11)
    mask = _mask()
    out = []
    for est in (_tail_est(), _tail_est(use_chunked_topk=True, chunked_topk_chunk_size=chunk)):
        leaf = logits.clone().requires_grad_(True)
        loss, per_token, metrics = forward_kl_topk(est, leaf, t_lp, t_ids, mask, **batch_normalisers(mask))
        loss.backward()
        out.append((loss, per_token, leaf.grad, metrics))
    (loss, per_token, grad, metrics), (c_loss, c_per_token, c_grad, c_metrics) = out
    torch.testing.assert_close(c_loss, loss, rtol=1e-13, atol=0)
    torch.testing.assert_close(c_per_token, per_token, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(c_grad, grad, rtol=1e-12, atol=1e-15)
    _assert_metrics_equal(c_metrics, metrics)


# --------------------------------------------------------------------------------------------------
# Through topk_distillation_loss with the estimator config
# --------------------------------------------------------------------------------------------------


def test_topk_distillation_loss_with_the_tail_estimator_config():
    logits, t_lp, t_ids = _random_inputs(12)
    mask = _mask()
    est = EstimatorConfig(loss_mode="forward_kl_topk_tail", topk=K, use_policy_gradient=False)
    assert est.uses_topk
    leaf = logits.clone().requires_grad_(True)
    terms = forward_kl_topk_terms(leaf, t_lp, t_ids, log_prob_min_clamp=est.log_prob_min_clamp)
    loss, per_token, metrics = topk_distillation_loss(est, terms, mask, **batch_normalisers(mask))
    loss.backward()
    ref_leaf = logits.clone().requires_grad_(True)
    ref = _reference(ref_leaf, t_lp, t_ids)  # (B, T)
    ref_loss = (ref * mask).sum() / mask.sum()  # token-mean
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(per_token[mask.bool()], ref[mask.bool()], rtol=1e-12, atol=1e-14)
    # verl's top-k metrics are kept; the tail adds distillation/tail_kl.
    for key in ("student_mass", "teacher_mass", "overlap_ratio", "overlap_token_advantage", "loss_min", "loss_max"):
        assert f"distillation/{key}" in metrics
    q = torch.softmax(logits, -1).gather(-1, t_ids).sum(-1)
    p = t_lp.exp().sum(-1)
    tail = (1 - p) * ((1 - p).log() - (1 - q).log())
    assert metrics["distillation/tail_kl"] == pytest.approx(float(tail[mask.bool()].mean()), rel=1e-12)
    assert metrics["distillation/student_mass"] == pytest.approx(float(q[mask.bool()].mean()), rel=1e-12)
    # forward_kl_topk's own numbers are untouched by the tail's terms: its loss is still the floored sum.
    verl_est = EstimatorConfig(loss_mode="forward_kl_topk", topk=K)
    _, verl_per_token, verl_metrics = topk_distillation_loss(verl_est, terms, mask, **batch_normalisers(mask))
    torch.testing.assert_close(verl_per_token, terms.per_token_loss.clamp_min(0.0), rtol=0, atol=0)
    assert "distillation/tail_kl" not in verl_metrics


def test_terms_without_the_log_masses_are_refused_for_the_tail():
    logits, t_lp, t_ids = _random_inputs(13)
    terms = forward_kl_topk_terms(logits, t_lp, t_ids)._replace(student_log_mass=None)
    mask = _mask()
    with pytest.raises(ValueError, match="student_log_mass"):
        topk_distillation_loss(_tail_est(), terms, mask, **batch_normalisers(mask))
