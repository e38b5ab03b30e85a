"""estimator=reverse_kl_topk (verl #7425 / #7590, not merged): the reverse KL over the student's own
top-k S_t, not renormalised, L_t = sum_{i in S_t} q_i (log q_i - log p_i), S_t chosen by the student
(detached), p the teacher's whole distribution from its hidden states. Checked in float64 against a
reference written here from the formula, by hand on a small case, against reverse_kl_full at k = V,
across chunk sizes and teachers, and through the mini-batch aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from miniverl.config.estimator import LOSS_AGG_MODES, EstimatorConfig
from miniverl.workers.full_vocab_loss import ReverseKLTopkTerms, reverse_kl_full, reverse_kl_full_terms
from miniverl.workers.losses import batch_normalisers, combine_metrics

B, T, H, V, K = 3, 5, 8, 11, 3


def heads_and_hidden(teacher_widths=(H,), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    student_head = torch.nn.Linear(H, V, bias=False, dtype=dtype)
    teacher_heads = [torch.nn.Linear(w, V, bias=False, dtype=dtype) for w in teacher_widths]
    with torch.no_grad():
        for head in (student_head, *teacher_heads):
            head.weight.copy_(torch.randn(head.weight.shape, generator=g, dtype=dtype))
            head.requires_grad_(False)
    student_hidden = torch.randn(B, T, H, generator=g, dtype=dtype, requires_grad=True)
    teacher_hidden = torch.randn(B, T, max(teacher_widths), generator=g, dtype=dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    return student_head, student_hidden, tokens, teacher_heads, teacher_hidden


def reference(student_head, student_hidden, tokens, teacher_heads, teacher_hidden, index, temperature, k):
    """(loss, student_mass, teacher_mass, S), each (B, T) but S (B, T, k), straight from the formula in
    float64: full log_softmax of both models, S the student's k largest logits at temperature, gathered."""
    logits = student_head(student_hidden) / temperature  # (B, T, V)
    log_q = logits.log_softmax(-1)
    log_p = torch.stack(
        [teacher_heads[int(i)](teacher_hidden[b, :, : teacher_heads[int(i)].in_features]) for b, i in enumerate(index)]
    ).log_softmax(-1)  # (B, T, V)
    S = logits.detach().topk(k, dim=-1).indices  # (B, T, k) the student's choice, not differentiated
    q_s, p_s = log_q.gather(-1, S), log_p.gather(-1, S)  # (B, T, k)
    loss = (q_s.exp() * (q_s - p_s)).sum(-1)
    return loss, q_s.exp().sum(-1).detach(), p_s.exp().sum(-1), S


def identity_head(n):
    head = torch.nn.Linear(n, n, bias=False, dtype=torch.float64).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(n, dtype=torch.float64))  # hidden = logits
    return head


def test_hand_derived_case_v4_k2_value_masses_and_gradient():
    # Student q = (.4, .3, .2, .1), teacher p = (.1, .2, .3, .4): S = {0, 1} (the student's top 2; the
    # teacher's would be {3, 2}).
    #   loss = .4 log(.4/.1) + .3 log(.3/.2) = .4 log 4 + .3 log 1.5
    #        = .4 x 1.3862944 + .3 x 0.4054651 = 0.5545177 + 0.1216395 = 0.6761573
    #   student mass .4 + .3 = .7, teacher mass on S .1 + .2 = .3.
    # Gradient w.r.t. the logits z, with a_i = log q_i - log p_i, dq_i/dz_j = q_i (d_ij - q_j):
    #   dL/dz_j = q_j (1[j in S] (a_j + 1) - (L + m_S)),  L + m_S = 1.3761573
    #   j=0: .4 (2.3862944 - 1.3761573) =  0.4040548
    #   j=1: .3 (1.4054651 - 1.3761573) =  0.0087923
    #   j=2: -.2 x 1.3761573            = -0.2752315
    #   j=3: -.1 x 1.3761573            = -0.1376157   (sum 0: shift invariance)
    q = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    z = q.log().view(1, 1, 4).clone().requires_grad_(True)
    head = identity_head(4)
    _, terms = reverse_kl_full_terms(
        head, z, torch.zeros(1, 1, dtype=torch.long), [head], p.log().view(1, 1, 4), None, topk=2
    )
    assert isinstance(terms, ReverseKLTopkTerms)
    expected = 0.4 * math.log(4) + 0.3 * math.log(1.5)
    assert float(terms.loss.detach()) == pytest.approx(0.6761573, abs=1e-7)
    assert float(terms.loss.detach()) == pytest.approx(expected, rel=1e-14)
    assert float(terms.student_mass) == pytest.approx(0.7, rel=1e-14)
    assert float(terms.teacher_mass) == pytest.approx(0.3, rel=1e-14)
    (grad,) = torch.autograd.grad(terms.loss.sum(), z)
    a = q.log() - p.log()
    in_s = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    closed_form = q * (in_s * (a + 1) - (expected + 0.7))
    torch.testing.assert_close(grad.view(4), closed_form, rtol=1e-12, atol=1e-14)
    hand = torch.tensor([0.4040548, 0.0087923, -0.2752315, -0.1376157], dtype=torch.float64)
    torch.testing.assert_close(grad.view(4), hand, rtol=0, atol=1e-7)
    # ... and the reference's autograd agrees.
    ref_loss, *_ = reference(head, z, None, [head], p.log().view(1, 1, 4), torch.zeros(1), 1.0, 2)
    (ref_grad,) = torch.autograd.grad(ref_loss.sum(), z)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)


def test_the_loss_can_be_negative_and_is_not_floored_but_loss_max_clamp_applies():
    # q = (.4, .3, .2, .1), p = (.45, .45, .05, .05), S = {0, 1}: .4 log(.4/.45) + .3 log(.3/.45) < 0.
    q = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    p = torch.tensor([0.45, 0.45, 0.05, 0.05], dtype=torch.float64)
    head = identity_head(4)
    z = q.log().view(1, 1, 4).clone().requires_grad_(True)
    _, terms = reverse_kl_full_terms(
        head, z, torch.zeros(1, 1, dtype=torch.long), [head], p.log().view(1, 1, 4), None, topk=2
    )
    expected = 0.4 * math.log(0.4 / 0.45) + 0.3 * math.log(0.3 / 0.45)
    assert expected < 0 and float(terms.loss.detach()) == pytest.approx(expected, rel=1e-13)
    mask = torch.ones(1, 1)
    est = EstimatorConfig(loss_mode="reverse_kl_topk", topk=2, use_policy_gradient=False)
    loss, per_token, metrics = reverse_kl_full(est, terms, mask, batch_num_tokens=1, global_batch_size=1)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-13)
    assert float(per_token.detach()) == pytest.approx(expected, rel=1e-13)
    assert metrics["distillation/loss_min"] == pytest.approx(expected, rel=1e-13)
    assert metrics["distillation/abs_loss"] == pytest.approx(-expected, rel=1e-13)
    clamped = EstimatorConfig(loss_mode="reverse_kl_topk", topk=2, use_policy_gradient=False, loss_max_clamp=0.05)
    loss, _, metrics = reverse_kl_full(clamped, terms, mask, batch_num_tokens=1, global_batch_size=1)
    assert float(loss.detach()) == pytest.approx(-0.05) and metrics["distillation/loss_min"] == pytest.approx(expected)
    (grad,) = torch.autograd.grad(loss, z)
    assert not grad.any()  # clamped: no gradient, as verl's clamp


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("k", [1, K, V - 1])
def test_values_masses_and_gradients_equal_the_float64_reference(temperature, k):
    parts = heads_and_hidden()
    index = torch.zeros(B, dtype=torch.long)
    log_prob, terms = reverse_kl_full_terms(*parts, None, temperature=temperature, chunk=4, topk=k)
    ref_loss, ref_student_mass, ref_teacher_mass, _ = reference(*parts, index, temperature, k)
    torch.testing.assert_close(terms.loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(terms.student_mass, ref_student_mass, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(terms.teacher_mass, ref_teacher_mass, rtol=1e-12, atol=1e-12)
    assert not terms.student_mass.requires_grad and not terms.teacher_mass.requires_grad
    ref_log_prob = (parts[0](parts[1]) / temperature).log_softmax(-1).gather(-1, parts[2][..., None]).squeeze(-1)
    torch.testing.assert_close(log_prob, ref_log_prob.detach(), rtol=1e-12, atol=1e-12)
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (ours,) = torch.autograd.grad((terms.loss * weights).sum(), parts[1])
    (theirs,) = torch.autograd.grad((ref_loss * weights).sum(), parts[1])
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_k_equal_to_v_is_reverse_kl_full_bit_for_bit(temperature):
    parts = heads_and_hidden()
    log_prob, kl = reverse_kl_full_terms(*parts, None, temperature=temperature, chunk=4)
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (grad_full,) = torch.autograd.grad((kl * weights).sum(), parts[1])
    for k in (V, V + 5):  # more than V: the whole vocabulary
        log_prob_k, terms = reverse_kl_full_terms(*parts, None, temperature=temperature, chunk=4, topk=k)
        assert torch.equal(terms.loss, kl) and torch.equal(log_prob_k, log_prob)
        torch.testing.assert_close(terms.student_mass, torch.ones(B, T, dtype=torch.float64), rtol=0, atol=1e-12)
        torch.testing.assert_close(terms.teacher_mass, torch.ones(B, T, dtype=torch.float64), rtol=0, atol=1e-12)
        (grad_k,) = torch.autograd.grad((terms.loss * weights).sum(), parts[1])
        assert torch.equal(grad_k, grad_full)


def test_the_selection_follows_the_student_not_the_teacher():
    parts = heads_and_hidden()
    student_head, student_hidden, tokens, teacher_heads, teacher_hidden = parts
    index = torch.zeros(B, dtype=torch.long)
    _, terms = reverse_kl_full_terms(*parts, None, topk=K)
    _, _, _, S = reference(*parts, index, 1.0, K)
    # Where the teacher's top-k differs from the student's, the loss is the sum over the student's.
    teacher_logits = teacher_heads[0](teacher_hidden)  # (B, T, V)
    teacher_S = teacher_logits.topk(K, dim=-1).indices
    differs = (S.sort(-1).values != teacher_S.sort(-1).values).any(-1)  # (B, T)
    assert differs.sum() >= T  # the random case has many such positions
    log_q = student_head(student_hidden).log_softmax(-1).detach()
    log_p = teacher_logits.log_softmax(-1)
    by_teacher = (log_q.gather(-1, teacher_S).exp() * (log_q - log_p).gather(-1, teacher_S)).sum(-1)
    by_student = (log_q.gather(-1, S).exp() * (log_q - log_p).gather(-1, S)).sum(-1)
    torch.testing.assert_close(terms.loss.detach(), by_student, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(terms.loss.detach()[differs], by_teacher[differs])
    # Another teacher: S stays the student's (same student mass, bit for bit); the loss moves only through p.
    other = torch.randn(teacher_hidden.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    other.requires_grad_(True)
    _, moved = reverse_kl_full_terms(student_head, student_hidden, tokens, teacher_heads, other, None, topk=K)
    assert torch.equal(moved.student_mass, terms.student_mass)
    ref_loss, _, ref_teacher_mass, ref_S = reference(
        student_head, student_hidden, tokens, teacher_heads, other, index, 1.0, K
    )
    assert torch.equal(ref_S, S)
    torch.testing.assert_close(moved.loss.detach(), ref_loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(moved.teacher_mass, ref_teacher_mass.detach(), rtol=1e-12, atol=1e-12)
    # No gradient reaches the teacher.
    (teacher_grad,) = torch.autograd.grad(moved.loss.sum(), other, allow_unused=True)
    assert teacher_grad is None or not teacher_grad.any()


def test_chunk_sizes_give_the_same_loss_and_gradients():
    parts = heads_and_hidden()
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for chunk in (1, 2, 3, 7, B * T, 64):
        log_prob, terms = reverse_kl_full_terms(*parts, None, temperature=0.7, chunk=chunk, topk=K)
        (grad,) = torch.autograd.grad((terms.loss * weights).sum(), parts[1])
        results.append((log_prob.detach(), *(t.detach() for t in terms), grad))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_several_teachers_of_different_widths_each_score_their_own_rows():
    parts = heads_and_hidden(teacher_widths=(H, 5))
    index = torch.tensor([1, 0, 1])
    _, terms = reverse_kl_full_terms(*parts, index, chunk=2, topk=K)
    ref_loss, ref_student_mass, ref_teacher_mass, _ = reference(*parts, index, 1.0, K)
    torch.testing.assert_close(terms.loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(terms.student_mass, ref_student_mass, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(terms.teacher_mass, ref_teacher_mass.detach(), rtol=1e-12, atol=1e-12)
    (ours,) = torch.autograd.grad(terms.loss.sum(), parts[1])
    (theirs,) = torch.autograd.grad(ref_loss.sum(), parts[1])
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    # Routing matters: the first teacher for every row gives other numbers on rows 0 and 2.
    _, first = reverse_kl_full_terms(*parts, torch.zeros(B, dtype=torch.long), chunk=2, topk=K)
    assert not torch.allclose(first.loss[0], terms.loss[0])
    torch.testing.assert_close(first.loss[1], terms.loss[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_the_mini_batch_loss_is_the_sum_over_row_chunks_with_its_normalisers(loss_agg_mode):
    parts = heads_and_hidden()
    student_head, student_hidden, tokens, teacher_heads, teacher_hidden = parts
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    est = EstimatorConfig(loss_mode="reverse_kl_topk", topk=K, use_policy_gradient=False, loss_agg_mode=loss_agg_mode)
    normalisers = batch_normalisers(mask)
    _, terms = reverse_kl_full_terms(*parts, None, topk=K)
    whole, per_token, metrics = reverse_kl_full(est, terms, mask, **normalisers)
    (whole_grad,) = torch.autograd.grad(whole, student_hidden)
    total, chunk_parts = 0.0, []
    for rows in (slice(0, 1), slice(1, 3)):
        _, chunk_terms = reverse_kl_full_terms(
            student_head, student_hidden[rows], tokens[rows], teacher_heads, teacher_hidden[rows], None, topk=K
        )
        loss, chunk_per_token, chunk_metrics = reverse_kl_full(est, chunk_terms, mask[rows], **normalisers)
        torch.testing.assert_close(chunk_per_token, per_token[rows], rtol=1e-12, atol=1e-12)
        total = total + loss
        chunk_parts.append((chunk_metrics, float(mask[rows].sum())))
    (chunk_grad,) = torch.autograd.grad(total, student_hidden)
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunk_grad, whole_grad, rtol=1e-12, atol=1e-12)
    # The expected mini-batch value, from the reference.
    ref_loss, ref_student_mass, ref_teacher_mass, _ = reference(*parts, torch.zeros(B, dtype=torch.long), 1.0, K)
    m = mask.bool()
    if loss_agg_mode == "token-mean":
        torch.testing.assert_close(whole, ref_loss[m].sum() / m.sum(), rtol=1e-12, atol=1e-12)
    # Metrics: verl's top-k names, and the chunks' combine to the mini-batch's.
    assert metrics["distillation/student_mass"] == pytest.approx(float(ref_student_mass[m].mean()), rel=1e-12)
    assert metrics["distillation/teacher_mass"] == pytest.approx(float(ref_teacher_mass[m].mean()), rel=1e-12)
    assert metrics["distillation/abs_loss"] == pytest.approx(float(ref_loss.detach()[m].abs().mean()), rel=1e-12)
    assert metrics["distillation/student_mass_max"] == pytest.approx(float(ref_student_mass[m].max()), rel=1e-12)
    assert "distillation/pg_clipfrac" not in metrics  # differentiated directly
    combined = combine_metrics(chunk_parts)
    assert combined.keys() == metrics.keys()
    for key, value in metrics.items():
        assert combined[key] == pytest.approx(value, rel=1e-12), key


def test_the_terms_must_match_the_loss_mode():
    parts = heads_and_hidden()
    mask = torch.ones(B, T)
    _, kl = reverse_kl_full_terms(*parts, None)
    _, terms = reverse_kl_full_terms(*parts, None, topk=K)
    topk_est = EstimatorConfig(loss_mode="reverse_kl_topk", topk=K, use_policy_gradient=False)
    full_est = EstimatorConfig(loss_mode="reverse_kl_full")
    with pytest.raises(ValueError, match="topk=est.topk"):
        reverse_kl_full(topk_est, kl, mask, batch_num_tokens=B * T, global_batch_size=B)
    with pytest.raises(ValueError, match="topk=None"):
        reverse_kl_full(full_est, terms, mask, batch_num_tokens=B * T, global_batch_size=B)
    # reverse_kl_full's metrics are unchanged: no top-k masses.
    _, _, metrics = reverse_kl_full(full_est, kl, mask, batch_num_tokens=B * T, global_batch_size=B)
    assert "distillation/student_mass" not in metrics and "distillation/abs_loss" in metrics
    with pytest.raises(ValueError, match="positive"):
        reverse_kl_full_terms(*parts, None, topk=0)
