"""estimator=reverse_kl_full: the exact reverse KL over the whole vocabulary, chunked, equals a
float64 textbook computation in value and gradient, for one teacher and for several of different
widths, whatever the chunk size."""

from __future__ import annotations

import pytest
import torch

from miniverl.config import to_config
from miniverl.config.estimator import EstimatorConfig
from miniverl.utils.errors import MiniverlError
from miniverl.workers.full_vocab_loss import reverse_kl_full, reverse_kl_full_terms

from conftest import compose_config

B, T, H, V = 3, 5, 8, 11


def heads_and_hidden(teacher_widths=(H,), dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
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


def textbook(student_head, student_hidden, tokens, teacher_heads, teacher_hidden, index, temperature):
    """log pi(y_t) and sum_v pi (log pi - log nu), straight from full log_softmax in float64."""
    log_pi = (student_head(student_hidden) / temperature).log_softmax(-1)  # (B, T, V)
    log_nu = torch.stack(
        [teacher_heads[int(i)](teacher_hidden[b, :, : teacher_heads[int(i)].in_features]) for b, i in enumerate(index)]
    ).log_softmax(-1)  # (B, T, V)
    kl = (log_pi.exp() * (log_pi - log_nu)).sum(-1)
    return log_pi.gather(-1, tokens[..., None]).squeeze(-1), kl


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_float64_textbook_kl(chunk, temperature):
    parts = heads_and_hidden()
    log_prob, kl = reverse_kl_full_terms(*parts, None, temperature=temperature, chunk=chunk)
    ref_log_prob, ref_kl = textbook(*parts, torch.zeros(B, dtype=torch.long), temperature)
    torch.testing.assert_close(log_prob, ref_log_prob.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl, ref_kl.detach(), rtol=1e-12, atol=1e-12)
    assert (kl > 0).all()  # a proper divergence between distinct distributions
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (ours,) = torch.autograd.grad((kl * weights).sum(), parts[1])
    (theirs,) = torch.autograd.grad((ref_kl * weights).sum(), parts[1])
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_the_gradient_with_respect_to_the_logits_is_pi_times_the_centred_log_ratio():
    """d KL_t / d z = pi (log pi - log nu - KL_t): the whole distribution moves, not one token."""
    z = torch.randn(V, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(V, V, bias=False, dtype=torch.float64).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(V, dtype=torch.float64))  # hidden = logits
    teacher_logits = torch.randn(1, 1, V, dtype=torch.float64)
    _, kl = reverse_kl_full_terms(
        head, z.view(1, 1, V), torch.zeros(1, 1, dtype=torch.long), [head], teacher_logits, None
    )
    (grad,) = torch.autograd.grad(kl.sum(), z)
    log_pi, log_nu = z.detach().log_softmax(-1), teacher_logits.view(V).log_softmax(-1)
    expected = log_pi.exp() * (log_pi - log_nu - float(kl.detach()))
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


def test_several_teachers_of_different_widths_each_score_their_own_rows():
    parts = heads_and_hidden(teacher_widths=(H, 5))
    index = torch.tensor([1, 0, 1])
    _, kl = reverse_kl_full_terms(*parts, index, chunk=2)
    _, ref_kl = textbook(*parts, index, 1.0)
    torch.testing.assert_close(kl, ref_kl.detach(), rtol=1e-12, atol=1e-12)


def test_the_loss_is_the_token_mean_of_the_kl_over_response_tokens():
    kl = torch.tensor([[1.0, 2.0, 9.0], [4.0, 0.5, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    est = EstimatorConfig(loss_mode="reverse_kl_full")
    loss, per_token, metrics = reverse_kl_full(est, kl, mask, batch_num_tokens=5, global_batch_size=2)
    assert float(loss) == pytest.approx((1 + 2 + 4 + 0.5 + 0) / 5)
    assert metrics["distillation/loss_max"] == 4.0 and metrics["distillation/abs_loss"] == pytest.approx(7.5 / 5)
    assert "distillation/pg_clipfrac" not in metrics  # differentiated directly, no policy gradient


def test_the_estimator_composes_and_refuses_a_policy_gradient():
    config = to_config(compose_config(["+recipe=opd_k1", "model=toy", "teacher=toy", "estimator=reverse_kl_full"]))
    assert config.estimator.teacher_target == "full_vocabulary_log_probabilities"
    assert config.estimator.loss_max_clamp is None and not config.estimator.use_policy_gradient
    with pytest.raises(MiniverlError, match="reverse_kl_full with use_policy_gradient=true is refused"):
        to_config(
            compose_config(
                [
                    "+recipe=opd_k1",
                    "model=toy",
                    "teacher=toy",
                    "estimator=reverse_kl_full",
                    "estimator.use_policy_gradient=true",
                ]
            )
        )
