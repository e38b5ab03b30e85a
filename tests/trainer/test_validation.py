"""The held-out probe (trainer/validation.py): its figures are their definitions — the exact reverse
KL(student || teacher) of the next-token distributions and the k1 mean over the sampled tokens —
computed here apart, from plain Hugging Face forwards in float64, on the probe's own samples."""

from __future__ import annotations

import pytest
import torch

from miniverl.config import to_config
from miniverl.trainer.opd_trainer import OPDTrainer
from miniverl.utils.identity import resolved_config

from conftest import compose_config


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    cfg = compose_config(
        [
            "+recipe=opd_k1_toy_distill",
            "eval.every=1",
            "recipe.optimizer_updates=1",
            "recipe.response_limit=8",
            "teacher.toy_pretrain_steps=5",  # a teacher apart from the student
            "trainer.progress_bar=false",
        ]
    )
    trainer = OPDTrainer(to_config(cfg), resolved_config(cfg), tmp_path_factory.mktemp("probe") / "run")
    trainer.setup()
    return trainer


def float64_log_probs(model, batch) -> torch.Tensor:
    """(B, R, V) log-probs of the next token at the response positions, from the whole model's logits."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    start = batch.prompt_length - 1  # position P + t - 1 predicts response token t
    return logits.logits[:, start : start + batch.response_length].double().log_softmax(-1)


def probes_samples(probe):
    """The probe's held-out batch again: the same sampling streams, scored by the same teacher."""
    every = [len(probe.prompts)]  # as measure() decodes them: in one physical batch
    batch = probe.rollout.generate_sequences(
        probe.prompts.token_ids, probe.prompts.rows, probe.seeds, response_limit=probe.response_limit,
        physical_batches=every,
    )  # fmt: skip
    return probe.teacher.compute_teacher_log_prob(batch, len(batch))


@torch.no_grad()
def test_the_probes_exact_reverse_kl_and_k1_mean_are_their_definitions(trainer):
    probe = trainer.probe
    values = probe.measure(trainer.eval_downshift)
    batch = probes_samples(probe)
    mask = batch.scored_mask.double()  # (B, R)
    student = float64_log_probs(trainer.student, batch)  # (B, R, V)
    teacher = float64_log_probs(trainer.teacher.model, batch)
    kl = (student.exp() * (student - teacher)).sum(-1)  # (B, R): sum_v p_s(v) (log p_s(v) - log p_t(v))
    assert values["exact_reverse_kl"] == pytest.approx(float((kl * mask).sum() / mask.sum()), rel=1e-4)
    forward = (teacher.exp() * (teacher - student)).sum(-1)  # KL(teacher || student): not what it measures
    assert abs(float((forward * mask).sum() / mask.sum()) - values["exact_reverse_kl"]) > 1e-2
    sampled = batch.responses[..., None]
    k1 = student.gather(-1, sampled).squeeze(-1) - teacher.gather(-1, sampled).squeeze(-1)  # (B, R)
    assert values["k1_mean"] == pytest.approx(float((k1 * mask).sum() / mask.sum()), rel=1e-4, abs=1e-5)
    assert values["k1_mean"] > 0.05  # the sign matters: the student's samples are likelier under the student


@torch.no_grad()
def test_every_held_out_prompt_has_its_own_stream_and_the_probe_measures_alike_twice(trainer):
    probe = trainer.probe
    assert len(set(probe.seeds)) == len(probe.prompts) == 16
    assert probe.measure(trainer.eval_downshift) == probe.measure(trainer.eval_downshift)


def setup_trainer(tmp_path, overrides: list[str]) -> OPDTrainer:
    cfg = compose_config([*overrides, "recipe.optimizer_updates=1", "recipe.response_limit=8"])
    trainer = OPDTrainer(to_config(cfg), resolved_config(cfg), tmp_path / "run")
    trainer.setup()  # with gradients: a toy teacher learns its corpus
    return trainer


def test_the_held_out_task_score_is_the_mean_over_samples_of_each_samples_score(tmp_path):
    rule = tmp_path / "length.py"  # a score every sample earns, unlike the toy's sums an untrained student misses
    rule.write_text("def score(data_source, solution_str, ground_truth, **kw):\n    return len(solution_str)")
    task = ["+recipe=opd_k1_grpo_toy", f"reward.custom_reward_function.path={rule}", "eval.every=1"]
    trainer = setup_trainer(tmp_path, [*task, "reward.custom_reward_function.name=score", "trainer.progress_bar=false"])
    probe = trainer.probe
    with torch.no_grad():
        value = probe.measure(trainer.eval_downshift)["task_score"]
        batch, scorer = probes_samples(probe), probe.scorer
    scores = []
    for i, row in enumerate(batch.prompt_rows.tolist()):  # each sample scored by its row's rule, by hand
        length = int(batch.response_mask[i].sum())
        text = scorer.tokenizer.decode(batch.responses[i, :length].tolist(), skip_special_tokens=True)
        task = scorer.tasks[row]
        scores.append(float(scorer.compute_score(data_source=task.data_source, solution_str=text,
                                                 ground_truth=task.ground_truth)))  # fmt: skip
    assert value == pytest.approx(sum(scores) / len(scores), rel=1e-6) and len(set(scores)) > 1


def test_a_teacher_of_another_tokenizer_is_measured_by_its_log_likelihood_per_character(tmp_path):
    cross = ["+recipe=opd_k1", "model=toy", "teacher=toy", "teacher.toy.tokenizer=bpe"]
    cross += ["teacher.tokenizer_alignment=text", "eval.every=1", "data.val_files=[data/toy_prompts_heldout.parquet]"]
    trainer = setup_trainer(tmp_path, [*cross, "trainer.progress_bar=false"])
    with torch.no_grad():
        values = trainer.probe.measure(trainer.eval_downshift)
        batch = probes_samples(trainer.probe)
    expected = float(batch.teacher_text_logprobs.sum()) / int(batch.response_chars.sum())  # nats per character
    assert values["teacher_loglik_per_char"] == pytest.approx(expected, rel=1e-9) and expected < 0
    assert values["exact_reverse_kl"] is None  # no common vocabulary to sum over
