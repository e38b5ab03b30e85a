"""estimator.kl_discount_factor (tinker-cookbook's): with policy gradient the advantage of response token
t is the discounted future loss A_t = -sum_{s>=t, same response} gamma^(s-t) d_s, d after loss_max_clamp;
gamma = 0 is verl's -d_t, bit for bit. estimator.advantage_baseline=batch_mean subtracts b, the update's
token mean of d under the sampling policy, from every d_s first."""

from __future__ import annotations

import math

import pytest
import torch

from miniverl.bench.loss_memory import toy_actor
from miniverl.config.estimator import LOSS_AGG_MODES, EstimatorConfig
from miniverl.workers.advantages import discounted_future_sum, policy_gradient_advantages
from miniverl.workers.logprobs import response_hidden_states
from miniverl.workers.losses import (
    agg_loss,
    batch_normalisers,
    combine_metrics,
    distillation_baseline,
    distillation_loss,
    ppo_clip_losses,
)


def reference_advantages(d: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """-sum_{s>=t} gamma^(s-t) d_s over the masked positions of each row, by the definition."""
    out = torch.zeros_like(d)
    for b in range(d.shape[0]):
        for t in range(d.shape[1]):
            if mask[b, t]:
                out[b, t] = -sum(gamma ** (s - t) * d[b, s] for s in range(t, d.shape[1]) if mask[b, s])
    return out


def k1_pg(gamma: float, **extra) -> EstimatorConfig:
    return EstimatorConfig(loss_mode="k1", use_policy_gradient=True, kl_discount_factor=gamma, **extra)


# Three rows: a whole response of 3, a padded one of 2, one of length 1.
HAND_D = torch.tensor([[1.0, 2.0, 4.0], [5.0, 6.0, 0.0], [7.0, 0.0, 0.0]], dtype=torch.float64)
HAND_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
# gamma = 0.5: row 0 -[1 + 0.5*2 + 0.25*4, 2 + 0.5*4, 4]; row 1 -[5 + 0.5*6, 6, 0]; row 2 -[7, 0, 0].
HAND_A = -torch.tensor([[3.0, 4.0, 4.0], [8.0, 6.0, 0.0], [7.0, 0.0, 0.0]], dtype=torch.float64)


def test_the_discounted_advantage_of_a_hand_derived_case():
    d = HAND_D.clone()
    d[1, 2] = d[2, 1] = d[2, 2] = 1e6  # padding contributes nothing, whatever it holds
    assert torch.equal(policy_gradient_advantages(k1_pg(0.5), d, HAND_MASK), HAND_A)
    torch.testing.assert_close(reference_advantages(d, HAND_MASK, 0.5), HAND_A, rtol=0, atol=0)


def test_distillation_loss_trains_on_the_discounted_advantage_of_a_hand_derived_case():
    """k1 on-policy, token-mean: the loss is mean(-A * ratio) = mean(-A) and d loss / d log_prob_t
    = -A_t / N. An infinite estimate at a padded position (teacher log-prob -inf) stays out."""
    teacher = -torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, float("inf")], [1.0, float("inf"), float("inf")]])
    teacher = teacher.double()
    log_prob = (teacher + HAND_D).where(HAND_MASK.bool(), torch.zeros(()).double()).requires_grad_(True)
    loss, per_token, metrics = distillation_loss(
        k1_pg(0.5), log_prob, None, teacher, HAND_MASK, **batch_normalisers(HAND_MASK)
    )
    loss.backward()
    n = HAND_MASK.sum()
    torch.testing.assert_close(loss, (-HAND_A).sum() / n, rtol=1e-15, atol=0)
    torch.testing.assert_close(log_prob.grad, -HAND_A / n * HAND_MASK, rtol=1e-15, atol=0)
    assert metrics["distillation/advantage_mean"] == pytest.approx(float(HAND_A.sum() / n), rel=1e-15)
    assert torch.equal(per_token[HAND_MASK.bool()], HAND_D[HAND_MASK.bool()])  # the per-token loss stays d


def test_the_log_depth_scan_is_the_definition_on_long_ragged_rows():
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([37, 1, 0, 20, 33, 5])
    mask = (torch.arange(37)[None] < lengths[:, None]).double()
    d = torch.randn(6, 37, generator=g, dtype=torch.float64)
    for gamma in (0.3, 0.97, 1.0):
        expected = reference_advantages(d, mask, gamma)
        torch.testing.assert_close(-discounted_future_sum(d, mask, gamma), expected, rtol=1e-13, atol=1e-13)
    assert torch.equal(policy_gradient_advantages(k1_pg(0.0), d, mask), -d)  # gamma 0: -d itself


def _inputs():
    """(B, T) float64 inputs with PPO clipping and dual clipping at work, ragged and empty rows."""
    g = torch.Generator().manual_seed(0)
    B, T = 8, 6
    lengths = torch.tensor([6, 3, 1, 5, 2, 4, 0, 0])
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    log_prob = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    old = log_prob + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6
    teacher = -torch.rand(B, T, generator=g, dtype=torch.float64) * 5
    old[:4, 0] = log_prob[:4, 0] - 2.0  # ratio e^2 > clip_ratio_c with negative advantages: dual clip
    teacher[:4, 0] = log_prob[:4, 0] - 1.0
    return log_prob, old, teacher, mask


def _reference_pg_loss(est, log_prob, old, teacher, mask, norms):
    """Vanilla dual-clip PPO built by hand from the advantage of the definition, k1 clamped."""
    d = (log_prob - teacher).detach().clamp(-est.loss_max_clamp, est.loss_max_clamp)
    adv = reference_advantages(d, mask, est.kl_discount_factor)
    ratio = torch.exp(log_prob - old)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - est.clip_ratio_low, 1 + est.clip_ratio_high))
    per_token = torch.where(adv < 0, torch.minimum(surrogate, -adv * est.clip_ratio_c), surrogate)
    return (per_token * mask).sum() / norms["batch_num_tokens"]


@pytest.mark.parametrize("gamma", [0.5, 0.9, 1.0])
def test_the_gradient_is_that_of_the_ppo_loss_built_by_hand_from_the_discounted_advantage(gamma):
    est = k1_pg(gamma, loss_max_clamp=1.5, clip_ratio_low=0.1, clip_ratio_high=0.28)
    log_prob, old, teacher, mask = _inputs()
    norms = batch_normalisers(mask)
    ours_lp, ref_lp = log_prob.clone().requires_grad_(True), log_prob.clone().requires_grad_(True)
    loss, _, metrics = distillation_loss(est, ours_lp, old, teacher, mask, **norms)
    loss.backward()
    reference = _reference_pg_loss(est, ref_lp, old, teacher, mask, norms)
    reference.backward()
    assert metrics["distillation/pg_clipfrac"] > 0 and metrics["distillation/pg_clipfrac_lower"] > 0
    torch.testing.assert_close(loss, reference, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(ours_lp.grad, ref_lp.grad, rtol=1e-13, atol=1e-15)


def test_gamma_zero_is_todays_loss_bit_for_bit():
    """kl_discount_factor 0 composes the building blocks exactly as before it existed (advantage -d)."""
    est = k1_pg(0.0, loss_max_clamp=1.5, clip_ratio_low=0.1, clip_ratio_high=0.28)
    log_prob, old, teacher, mask = _inputs()
    norms = dict(batch_normalisers(mask), loss_scale_factor=6)
    for agg in LOSS_AGG_MODES:
        est.loss_agg_mode = agg
        ours_lp, ref_lp = log_prob.clone().requires_grad_(True), log_prob.clone().requires_grad_(True)
        loss, per_token, metrics = distillation_loss(est, ours_lp, old, teacher, mask, **norms)
        loss.backward()
        d = (ref_lp - teacher).clamp(-1.5, 1.5)
        pg, _ = ppo_clip_losses(
            ref_lp, old, -d.detach(), mask.bool(), clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=3.0
        )
        reference = agg_loss(pg, mask.bool(), agg, **norms)
        reference.backward()
        assert torch.equal(loss, reference) and torch.equal(ours_lp.grad, ref_lp.grad)
        assert torch.equal(per_token, d)
        assert "distillation/advantage_mean" not in metrics  # verl's metrics only


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("n_chunks", [2, 4])
def test_the_mini_batch_loss_is_the_sum_over_row_chunks_with_its_normalisers(loss_agg_mode, n_chunks):
    """The discount runs within a row, so row chunks (update chunks) see whole responses."""
    est = k1_pg(0.9, loss_max_clamp=1.5, clip_ratio_low=0.1, clip_ratio_high=0.28, loss_agg_mode=loss_agg_mode)
    log_prob, old, teacher, mask = _inputs()
    norms = dict(batch_normalisers(mask), loss_scale_factor=6)
    results = []
    for n in (1, n_chunks):
        lp = log_prob.clone().requires_grad_(True)
        size, total, parts = 8 // n, 0.0, []
        for s in range(0, 8, size):
            rows = slice(s, s + size)
            loss, _, metrics = distillation_loss(est, lp[rows], old[rows], teacher[rows], mask[rows], **norms)
            loss.backward()
            total = total + loss.detach()
            parts.append((metrics, mask[rows].sum()))
        results.append((total, lp.grad, combine_metrics(parts)))
    (whole, whole_grad, whole_metrics), (chunked, chunk_grad, chunk_metrics) = results
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(chunk_grad, whole_grad, rtol=1e-12, atol=1e-14)
    assert chunk_metrics.keys() == whole_metrics.keys()
    for key, value in whole_metrics.items():
        # rel 1e-8: verl's masked means (pg_clipfrac, ppo_kl) divide by count + 1e-8, chunk by chunk
        assert chunk_metrics[key] == pytest.approx(value, rel=1e-8, abs=1e-12), key


def test_the_actor_stores_the_discounted_advantage_it_trained_on():
    """update_actor's `advantages` column is -sum_{s>=t} gamma^(s-t) d_s of the per-token loss (by the
    definition), and the LoRA gradient is that of the textbook loss over full logits (float64 toy)."""
    from test_token_selection import reference_loss, toy

    actor, batch = toy(k1_pg(0.8, loss_max_clamp=2.0))
    metrics, per_token, _ = actor.accumulate_gradients(batch, [2, 2])
    ours = {n: p.grad.clone() for n, p in zip(actor.param_names, actor.params)}
    actor.optimizer.zero_grad(set_to_none=True)
    assert "actor/distillation/advantage_mean" in metrics
    reference, _ = reference_loss(actor, batch, batch.response_mask)  # the same estimator, full logits
    reference.backward()
    for name, p in zip(actor.param_names, actor.params):
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-9, atol=1e-12)
    actor.optimizer.zero_grad(set_to_none=True)
    trained, _ = actor.update_actor(batch, [4])
    expected = reference_advantages(per_token, batch.response_mask, 0.8)
    torch.testing.assert_close(trained.advantages, expected, rtol=1e-13, atol=1e-13)
    assert not torch.equal(trained.advantages, -per_token * batch.response_mask)  # the discount is at work


def test_a_baseline_is_subtracted_from_each_tokens_estimate_before_the_discount():
    d = HAND_D.clone()
    d[1, 2] = d[2, 1] = d[2, 2] = 1e6  # padding contributes nothing, whatever it holds
    # b = 2, gamma = 0.5: d - b = [-1, 0, 2], [3, 4], [5]; row 0 -[-1 + 0 + 0.25*2, 0 + 0.5*2, 2]; row 1 -[3 + 0.5*4, 4]
    expected = -torch.tensor([[-0.5, 1.0, 2.0], [5.0, 4.0, 0.0], [5.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.equal(policy_gradient_advantages(k1_pg(0.5), d, HAND_MASK, 2.0), expected)
    torch.testing.assert_close(reference_advantages((HAND_D - 2.0) * HAND_MASK, HAND_MASK, 0.5), expected)
    # gamma 0: -(d - b) on the response, 0 on padding
    assert torch.equal(policy_gradient_advantages(k1_pg(0.0), d, HAND_MASK, 2.0), -(HAND_D - 2.0) * HAND_MASK)


def test_the_batch_mean_baseline_is_the_token_mean_of_the_clamped_estimate_under_the_sampling_policy():
    sampled = torch.tensor([[-1.0, -2.0, -30.0], [-0.5, -1.5, -7.0]], dtype=torch.float64)
    teacher = torch.tensor([[-2.0, -1.0, -1.0], [-0.5, -4.0, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    # k1 = sampled - teacher = [1, -1, -29 -> -10 (clamped)], [0, 2.5] (the third is padding): mean -7.5 / 5
    mean_k1 = k1_pg(0.9, advantage_baseline="batch_mean", loss_max_clamp=10.0)
    assert distillation_baseline(mean_k1, sampled, teacher, mask) == pytest.approx(-1.5, rel=1e-15)
    assert distillation_baseline(k1_pg(0.9), sampled, teacher, mask) == 0.0  # none: verl's advantage
    # k3 = r - log r - 1 with r = teacher prob / sampled prob, by its formula
    k3 = EstimatorConfig(loss_mode="k3", use_policy_gradient=True, advantage_baseline="batch_mean")
    log_r = [1 - 2 + 0.0, -1 + 2, -1 + 30, 0.0, -4 + 1.5]  # teacher - sampled at the five response tokens
    terms = [min(math.exp(x) - x - 1, 10.0) for x in log_r]  # verl bounds k3 at 10
    assert distillation_baseline(k3, sampled, teacher, mask) == pytest.approx(sum(terms) / 5, rel=1e-12)


def test_a_baseline_needs_a_per_token_policy_gradient_advantage():
    with pytest.raises(ValueError, match="advantage_baseline=batch_mean: a baseline is subtracted from an advantage"):
        EstimatorConfig(loss_mode="k3", use_policy_gradient=False, advantage_baseline="batch_mean")
    with pytest.raises(ValueError, match="advantage_baseline='mean'; choose one of none, batch_mean"):
        k1_pg(0.0, advantage_baseline="mean")


def test_the_actor_trains_on_and_stores_the_advantage_less_the_batch_mean_baseline():
    """b comes from the sampling policy's log-probs (the rollout's, on-policy) before any chunk's
    backward; the LoRA gradient is that of the textbook PG loss -sum_t A_t log pi(y_t) / N over full
    logits with A from the definition, and update_actor's `advantages` column is that A."""
    gamma, clamp = 0.8, 2.0
    actor, batch = toy_actor(k1_pg(gamma, loss_max_clamp=clamp, advantage_baseline="batch_mean"))
    mask = batch.response_mask
    g = torch.Generator().manual_seed(5)
    batch.rollout_log_probs = ((batch.teacher_logprobs + torch.randn(mask.shape, generator=g)) * mask).float()
    b = float((batch.rollout_log_probs - batch.teacher_logprobs).clamp(-clamp, clamp)[mask.bool()].mean())
    assert abs(b) > 0.1  # a baseline that matters
    metrics, per_token, _ = actor.accumulate_gradients(batch, [2, 2])
    assert metrics["actor/distillation/advantage_baseline"] == pytest.approx(b, rel=1e-12)
    ours = {n: p.grad.clone() for n, p in zip(actor.param_names, actor.params)}
    actor.optimizer.zero_grad(set_to_none=True)

    actor.peft_model.train()
    logits = actor.model.get_output_embeddings()(response_hidden_states(actor.model, batch)) / actor.temperature
    log_prob = logits.log_softmax(-1).gather(-1, batch.responses[..., None]).squeeze(-1)  # (B, R)
    d = (log_prob.detach() - batch.teacher_logprobs).clamp(-clamp, clamp) * mask
    advantages = reference_advantages((d - b) * mask, mask, gamma)
    (-(advantages * log_prob * mask).sum() / mask.sum()).backward()
    for name, p in zip(actor.param_names, actor.params):
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-9, atol=1e-12)
    actor.optimizer.zero_grad(set_to_none=True)

    trained, _ = actor.update_actor(batch, [4])
    torch.testing.assert_close(trained.advantages, reference_advantages((per_token - b) * mask, mask, gamma))


def test_the_baseline_is_taken_from_the_batchs_old_log_probs_where_it_has_them():
    """Bypass mode, or a batch with its old log-probs: the sampling policy is theirs, not the rollout's."""
    actor, batch = toy_actor(k1_pg(0.5, advantage_baseline="batch_mean"))
    mask = batch.response_mask.bool()
    on_policy = float((batch.rollout_log_probs - batch.teacher_logprobs)[mask].mean())
    assert actor.baseline_for(batch) == pytest.approx(on_policy, rel=1e-12)
    batch.old_log_probs = (batch.teacher_logprobs + 1.5) * batch.response_mask  # k1 = 1.5 on every response token
    assert actor.baseline_for(batch) == pytest.approx(1.5, rel=1e-6)
    actor.estimator.advantage_baseline = "none"
    assert actor.baseline_for(batch) == 0.0


def test_with_a_teacher_of_another_tokenizer_the_stored_advantage_is_the_one_trained_on():
    """A teacher with another tokenizer leaves some response tokens unscored (Batch.scored_mask): the
    discounted advantage runs over the scored ones. update_actor's `advantages` column summed over the
    whole response instead (a house-style review found -0.455 stored where -0.905 was trained on).
    Checked by the gradient: the textbook PG loss -sum_t A_t log pi(y_t) / N with the stored A, over
    the scored tokens, has the LoRA gradient the actor computed."""
    gamma = 0.8
    est = k1_pg(gamma, advantage_baseline="batch_mean")

    def aligned(batch):  # each token its own span, two left unaligned
        span = torch.arange(batch.responses.shape[1]).expand_as(batch.responses).clone()  # (B, R)
        span[0, 1] = span[1, 0] = -1
        batch.student_span = span * batch.response_mask.long() - (1 - batch.response_mask.long())
        batch.teacher_span_logprobs = batch.teacher_logprobs.double()  # (B, S = R)
        return batch

    actor, batch = toy_actor(est)
    batch = aligned(batch)
    scored = batch.scored_mask
    assert float((batch.response_mask - scored).sum()) == 2
    actor.accumulate_gradients(batch, [2, 2])
    ours = {n: p.grad.clone() for n, p in zip(actor.param_names, actor.params)}
    actor.optimizer.zero_grad(set_to_none=True)
    stepped, same = toy_actor(est)  # the same start: update_actor takes its step there
    trained, _ = stepped.update_actor(aligned(same), [4])

    actor.peft_model.train()
    logits = actor.model.get_output_embeddings()(response_hidden_states(actor.model, batch)) / actor.temperature
    log_prob = logits.log_softmax(-1).gather(-1, batch.responses[..., None]).squeeze(-1)  # (B, R)
    (-(trained.advantages * log_prob * scored).sum() / scored.sum()).backward()
    for name, p in zip(actor.param_names, actor.params):
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-9, atol=1e-12)
