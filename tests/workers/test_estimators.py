"""Every verl distillation loss runs in the toy recipe, verl's refusals hold at composition, and
one mini-batch gives the same loss and LoRA gradients however it is split into update chunks."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from miniverl.config import to_config
from miniverl.config.estimator import ESTIMATOR_MODES, LOSS_AGG_MODES, LOSS_MODES
from miniverl.trainer.opd_trainer import OPDTrainer
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import resolved_config

from conftest import CONF, SHORT, compose_config

OPTIONS = sorted(p.stem for p in (CONF / "estimator").glob("*.yaml"))
RUNS = [(m, pg) for m in ESTIMATOR_MODES for pg in (True, False) if (m, pg) != ("k1", False)]
RUNS += [("forward_kl_topk", False), ("forward_kl_topk", True), ("reverse_kl_full", False)]
RUNS += [("forward_kl_topk_tail", False), ("reverse_kl_topk", False)]  # beyond verl (docs/objectives.md)
TINY = ["recipe.optimizer_updates=2", "recipe.response_limit=8", "actor.optim.lr=1e-3"]


def test_every_loss_has_an_option():
    assert set(OPTIONS) == set(LOSS_MODES)


def run_toy(tmp_path, *overrides):
    cfg = compose_config(["+recipe=opd_k1", *SHORT, *TINY, *overrides])
    trainer = OPDTrainer(to_config(cfg), resolved_config(cfg), tmp_path)
    trainer.setup()
    trainer.train()
    return trainer, trainer.finish()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:forward_kl_topk with use_policy_gradient")
@pytest.mark.parametrize("mode,pg", RUNS, ids=[f"{m}-{'pg' if pg else 'direct'}" for m, pg in RUNS])
def test_the_toy_recipe_runs_with_every_loss(tmp_path, mode, pg):
    trainer, report = run_toy(tmp_path, f"estimator={mode}", f"estimator.use_policy_gradient={pg}")
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert report["recipe"]["estimator"] == mode and len(lines) == 2
    for metrics in lines:
        assert math.isfinite(metrics["actor/distillation/loss"]) and math.isfinite(metrics["actor/grad_norm"])
        assert ("actor/distillation/pg_clipfrac" in metrics) == pg
        assert "actor/pg_clipfrac" not in metrics  # verl's name of the task PPO loss's: no task rewards here
        if mode == "forward_kl_topk":
            for name in ("student_mass", "teacher_mass", "overlap_ratio", "overlap_token_advantage"):
                assert f"actor/distillation/{name}" in metrics
    if mode == "forward_kl_topk":
        assert report["recipe"]["teacher_target"] == "top_k_log_probabilities"
    if mode == "reverse_kl_full":
        assert report["recipe"]["teacher_target"] == "full_vocabulary_log_probabilities"
        assert lines[1]["actor/distillation/loss"] < lines[0]["actor/distillation/loss"]  # the KL it descends


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["estimator=k1", "estimator.use_policy_gradient=false"], "loss_mode=k1 with use_policy_gradient=false"),
        (["estimator.policy_loss_mode=gspo"], "supports only 'vanilla'"),
        (["estimator.loss_mode=k3+"], "is not a distillation loss of verl v0.8.0 or miniverl"),
        (["estimator.loss_mode=bogus"], "is not a distillation loss of verl v0.8.0 or miniverl"),
        (["estimator.loss_agg_mode=seq-sum"], "loss_agg_mode='seq-sum'"),
    ],
)
def test_combinations_verl_refuses_are_refused_when_the_config_is_composed(overrides, message):
    with pytest.raises(MiniverlError, match=message.replace("+", r"\+")):
        to_config(compose_config(["+recipe=opd_k1", "model=toy", "teacher=toy", *overrides]))


def test_forward_kl_topk_with_policy_gradient_composes_with_a_warning():
    with pytest.warns(UserWarning, match="top-k signal is largely unused"):
        config = to_config(compose_config(["estimator=forward_kl_topk", "estimator.use_policy_gradient=true"]))
    assert config.estimator.teacher_target == "top_k_log_probabilities"


@pytest.fixture(scope="module")
def scored_batches(tmp_path_factory):
    """A rolled-out, teacher-scored batch of 4 per estimator family, with a non-zero LoRA B."""
    out = {}
    for name, overrides in {
        "k1": ["estimator=k1"],
        "k3": ["estimator=k3"],
        "topk": ["estimator=forward_kl_topk", "estimator.topk=8"],
        "full": ["estimator=reverse_kl_full"],
    }.items():
        cfg = compose_config(["+recipe=opd_k1", *SHORT, *overrides])
        trainer = OPDTrainer(to_config(cfg), resolved_config(cfg), tmp_path_factory.mktemp(name))
        trainer.setup()
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for n, p in trainer.student.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        update = trainer.plan.updates[0]
        rows = [trainer.prompts.rows.index(r) for r in update.prompt_rows]
        batch = trainer.rollout.generate_sequences(
            [trainer.prompts.token_ids[i] for i in rows],
            list(update.prompt_rows),
            list(update.sample_seeds),
            response_limit=16,
            physical_batches=[4],
        )
        batch = trainer.teacher.compute_teacher_log_prob(batch, 4)
        batch.old_log_probs = trainer.actor.compute_log_prob(batch, rows_per_forward=4)
        out[name] = (trainer, batch)
    return out


@pytest.mark.parametrize("family", ["k1", "k3", "topk", "full"])
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.slow
def test_loss_and_lora_gradients_do_not_depend_on_the_update_chunks(scored_batches, family, agg):
    trainer, batch = scored_batches[family]
    actor = trainer.actor
    actor.estimator.loss_agg_mode = agg
    results = []
    for chunks in ([4], [2, 2], [1, 1, 1, 1]):
        metrics, per_token, _ = actor.accumulate_gradients(batch, chunks)
        grads = {n: p.grad.clone() for n, p in trainer.student.named_parameters() if p.requires_grad}
        results.append((metrics, per_token, grads))
    actor.optimizer.zero_grad(set_to_none=True)
    (m1, t1, g1) = results[0]
    assert any(g.abs().sum() > 0 for g in g1.values())
    for metrics, per_token, grads in results[1:]:
        assert metrics["actor/distillation/loss"] == pytest.approx(m1["actor/distillation/loss"], rel=1e-5, abs=1e-7)
        for key in ("actor/distillation/abs_loss", "actor/distillation/loss_max", "actor/distillation/student_mass"):
            if key in m1:
                assert metrics[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7)
        torch.testing.assert_close(per_token, t1, rtol=1e-5, atol=1e-6)
        for name in g1:
            torch.testing.assert_close(grads[name], g1[name], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("family", ["k1", "k3", "topk", "full"])
@pytest.mark.parametrize("chunks", [[4], [2, 2]])
def test_the_updates_own_old_log_probs_equal_a_separate_recompute_bitwise(scored_batches, family, chunks):
    """On-policy, update_actor fills old_log_probs from its own forward: the same bits as verl's
    separate compute_log_prob pass (eval mode, no autograd), and the same LoRA gradients."""
    trainer, batch = scored_batches[family]
    actor = trainer.actor
    recomputed = actor.compute_log_prob(batch, rows_per_forward=chunks[0])
    grads, metrics = [], []
    for old in (recomputed, None):
        each = dataclasses.replace(batch, old_log_probs=old)
        step_metrics, _, own_log_probs = actor.accumulate_gradients(each, chunks)
        metrics.append(step_metrics)
        grads.append({n: p.grad.clone() for n, p in trainer.student.named_parameters() if p.requires_grad})
        if old is None:
            assert torch.equal(own_log_probs, recomputed)
    actor.optimizer.zero_grad(set_to_none=True)
    assert any(g.abs().sum() > 0 for g in grads[0].values())
    if actor.estimator.use_policy_gradient:  # only there does the PPO ratio read the old log-probs
        assert metrics[0]["actor/distillation/ppo_kl"] == 0.0  # the separate pass: a ratio of exactly 1 as well
        for name in grads[0]:
            assert torch.equal(grads[0][name], grads[1][name]), name


@pytest.mark.parametrize("family", ["k1", "k3", "topk", "full"])
def test_actor_gradients_equal_those_of_a_plain_full_forward(scored_batches, family):
    """The chunked, checkpointed log-prob path computes the same LoRA gradients as the textbook
    one: full logits from the PEFT model, log_softmax, gather."""
    from miniverl.workers.full_vocab_loss import reverse_kl_full
    from miniverl.workers.losses import distillation_loss
    from miniverl.workers.topk_loss import forward_kl_topk

    trainer, batch = scored_batches[family]
    actor, est = trainer.actor, trainer.actor.estimator
    est.loss_agg_mode = "token-mean"
    actor.accumulate_gradients(batch, [4])
    ours = {n: p.grad.clone() for n, p in trainer.student.named_parameters() if p.requires_grad}
    actor.optimizer.zero_grad(set_to_none=True)
    trainer.student.train()
    logits = trainer.student(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    ).logits.float()
    P, R, mask = batch.prompt_length, batch.response_length, batch.response_mask
    response_logits = logits[:, P - 1 : P - 1 + R]  # (B, R, V)
    log_prob = response_logits.log_softmax(-1).gather(-1, batch.responses[..., None]).squeeze(-1)
    norms = dict(
        batch_num_tokens=float(mask.sum()),
        global_batch_size=int((mask.sum(-1) > 0).sum()),
        loss_scale_factor=trainer.cfg.recipe.response_limit,
    )
    if family == "topk":
        loss, _, _ = forward_kl_topk(
            est,
            response_logits,
            batch.teacher_topk_logprobs,
            batch.teacher_ids,
            mask,
            log_prob=log_prob,
            old_log_prob=batch.old_log_probs,
            **norms,
        )
    elif family == "full":
        teacher = trainer.teacher.compute_full_log_probs(batch)  # (B, R, V)
        student = response_logits.log_softmax(-1)
        kl = (student.exp() * (student - teacher)).sum(-1)  # (B, R)
        loss, _, _ = reverse_kl_full(est, kl, mask, **norms)
    else:
        loss, _, _ = distillation_loss(est, log_prob, batch.old_log_probs, batch.teacher_logprobs, mask, **norms)
    loss.backward()
    trainer.student.eval()
    reference = {n: p.grad.clone() for n, p in trainer.student.named_parameters() if p.requires_grad}
    actor.optimizer.zero_grad(set_to_none=True)
    assert ours.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-4, atol=1e-8)
