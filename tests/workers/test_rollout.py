"""The rollout: per-sample sampling streams make the tokens independent of the physical batch
split where the products round alike (the toy computes in float32; in bf16 they need not:
docs/resume.md); a failed resume check makes the command fail."""

from __future__ import annotations

import pytest
import torch

from miniverl.config import to_config
from miniverl.trainer import runner
from miniverl.trainer.opd_trainer import OPDTrainer
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import resolved_config

from conftest import SHORT, compose_config


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    cfg = compose_config(["+recipe=opd_k1", *SHORT])
    trainer = OPDTrainer(to_config(cfg), resolved_config(cfg), tmp_path_factory.mktemp("rollout"))
    trainer.setup()
    return trainer


def generate(trainer, physical_batches, update=0, limit=24):
    plan = trainer.plan.updates[update]
    rows = [trainer.prompts.rows.index(r) for r in plan.prompt_rows]
    return trainer.rollout.generate_sequences(
        [trainer.prompts.token_ids[i] for i in rows],
        list(plan.prompt_rows),
        list(plan.sample_seeds),
        response_limit=limit,
        physical_batches=physical_batches,
    )


def test_physical_batch_1_2_and_4_sample_the_same_tokens(trainer):
    whole = generate(trainer, [4])
    assert whole.response_mask.sum() > 4  # something was sampled
    for split in ([2, 2], [1, 1, 1, 1], [1, 3]):
        other = generate(trainer, split)
        assert torch.equal(other.responses, whole.responses)
        assert torch.equal(other.response_mask, whole.response_mask)
        torch.testing.assert_close(other.rollout_log_probs, whole.rollout_log_probs, rtol=1e-5, atol=1e-5)


def test_sampling_is_reproducible_and_seed_dependent(trainer):
    first, again = generate(trainer, [4]), generate(trainer, [4])
    assert torch.equal(first.responses, again.responses)
    plan = trainer.plan.updates[0]
    rows = [trainer.prompts.rows.index(r) for r in plan.prompt_rows]
    other_seeds = trainer.rollout.generate_sequences(
        [trainer.prompts.token_ids[i] for i in rows],
        list(plan.prompt_rows),
        list(trainer.plan.updates[1].sample_seeds),
        response_limit=24,
        physical_batches=[4],
    )
    assert not torch.equal(first.responses, other_seeds.responses)  # same prompts, other streams


@torch.no_grad()
def test_at_temperature_0_7_the_rollout_samples_and_scores_the_tempered_distribution(tmp_path):
    """The rollout's log-probs are log_softmax(logits / T) of the student at the sampled tokens (a tests
    audit dropped the division: only a slow bench test noticed)."""
    cfg = compose_config(["+recipe=opd_k1", *SHORT, "rollout.temperature=0.7"])
    tempered = OPDTrainer(to_config(cfg), resolved_config(cfg), tmp_path)
    tempered.setup()
    batch = generate(tempered, [4])
    student = tempered.student.eval()
    out = student(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    start = batch.prompt_length - 1  # position P + t - 1 predicts response token t
    logits = out.logits[:, start : start + batch.response_length].double()  # (B, R, V)
    sampled = batch.responses[..., None]
    for temperature, close in ((0.7, True), (1.0, False)):
        expected = (logits / temperature).log_softmax(-1).gather(-1, sampled).squeeze(-1) * batch.response_mask
        same = torch.allclose(batch.rollout_log_probs.double(), expected, atol=1e-4, rtol=0)
        assert same == close, temperature


@pytest.mark.slow
def test_a_failed_resume_check_fails_the_command(monkeypatch, tmp_path):
    import miniverl.trainer.resume_check as resume_check

    monkeypatch.setattr(
        resume_check,
        "verify_resume",
        lambda run_dir, overrides, k: {
            "status": "mismatch",
            "first_difference": "adapter.safetensors of update_3 differs",
        },
    )
    cfg = compose_config(["+recipe=opd_k1", *SHORT, "recipe.interrupt_after_updates=1"])
    with pytest.raises(MiniverlError, match="resume check failed: adapter.safetensors of update_3 differs"):
        runner.run(cfg, tmp_path / "run")
    import json

    assert json.loads((tmp_path / "run" / "report.json").read_text())["resume"]["status"] == "mismatch"
