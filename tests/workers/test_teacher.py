"""Teacher modes and adapters: `ref` is the student's base without its LoRA, `shared_base` is a
teacher adapter on the student's own base weights (one copy), `model.adapter` starts the student
from exactly an adapter's weights, and adapters that do not fit are refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from miniverl.config import to_config
from miniverl.models import loading as models
from miniverl.trainer.opd_trainer import OPDTrainer
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import resolved_config
from miniverl.workers.logprobs import response_log_probs

from conftest import SHORT, compose_config

TINY = [*SHORT, "recipe.optimizer_updates=2", "actor.optim.lr=1e-3"]


def trainer_for(tmp_path, name, *extra, train=False):
    cfg = compose_config(["+recipe=opd_k1", *TINY, *extra])
    trainer = OPDTrainer(to_config(cfg), resolved_config(cfg), tmp_path / name)
    trainer.setup()
    if train:
        trainer.train()
        trainer.finish()
    return trainer


@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory):
    """A PEFT adapter trained by a toy run on the same toy student base (same seed)."""
    tmp = tmp_path_factory.mktemp("adapter")
    trainer_for(tmp, "donor", train=True)
    return tmp / "donor" / "peft_adapter"


def rolled_out_batch(trainer, update=0):
    plan = trainer.plan.updates[update]
    rows = [trainer.prompts.rows.index(r) for r in plan.prompt_rows]
    return trainer.rollout.generate_sequences(
        [trainer.prompts.token_ids[i] for i in rows],
        list(plan.prompt_rows),
        list(plan.sample_seeds),
        response_limit=12,
        physical_batches=[4],
    )


def fresh_base(trainer):
    block = trainer.cfg.model
    return models.load_causal_lm(
        "model", block, models.source_of(block, trainer.run_dir / "toy_models" / "student"), torch.device("cpu")
    ).eval()


def test_ref_mode_scores_with_the_base_model_without_the_adapter(tmp_path):
    trainer = trainer_for(tmp_path, "ref", "teacher.mode=ref")
    with torch.no_grad():
        for name, p in trainer.student.named_parameters():
            if "lora_B" in name:
                p.fill_(0.02)  # make the adapter matter
    batch = rolled_out_batch(trainer)
    teacher = trainer.teacher.compute_teacher_log_prob(batch, 4).teacher_logprobs
    with torch.no_grad():
        base = response_log_probs(fresh_base(trainer), batch) * batch.response_mask
        student = response_log_probs(trainer.student.get_base_model(), batch) * batch.response_mask
    torch.testing.assert_close(teacher, base, rtol=1e-5, atol=1e-5)
    assert (teacher - student).abs().max() > 1e-3  # the adapter is back on for the student
    assert not (trainer.run_dir / "toy_models" / "teacher").exists()  # no second model


def test_shared_base_equals_a_separate_model_with_the_adapter_on_one_copy_of_the_base(tmp_path, trained_adapter):
    trainer = trainer_for(tmp_path, "shared", "teacher.mode=shared_base", f"teacher.adapter={trained_adapter}")
    assert trainer.teacher.model is trainer.student.get_base_model()  # the teacher runs on the student's modules
    layer = trainer.student.get_base_model().model.layers[0].self_attn.q_proj
    assert set(layer.lora_A.keys()) == {"default", "teacher"}
    assert (
        layer.base_layer.weight.data_ptr()
        == trainer.teacher.model.model.layers[0].self_attn.q_proj.base_layer.weight.data_ptr()
    )
    assert not (trainer.run_dir / "toy_models" / "teacher").exists()
    batch = rolled_out_batch(trainer)
    teacher = trainer.teacher.compute_teacher_log_prob(batch, 4).teacher_logprobs
    separate = PeftModel.from_pretrained(fresh_base(trainer), str(trained_adapter)).eval()
    with torch.no_grad():
        expected = response_log_probs(separate.get_base_model(), batch) * batch.response_mask
    torch.testing.assert_close(teacher, expected, rtol=1e-5, atol=1e-5)
    assert trainer.student.active_adapter == "default"


def test_shared_base_trains_the_students_lora_and_never_the_teachers(tmp_path, trained_adapter):
    trainer = trainer_for(tmp_path, "shared", "teacher.mode=shared_base", f"teacher.adapter={trained_adapter}")
    params = dict(trainer.student.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items() if "lora_" in n}
    assert {n for n, p in params.items() if p.requires_grad} == {n for n in before if ".default." in n}
    trainer.train()
    trainer.finish()
    after = {n: p.detach() for n, p in trainer.student.named_parameters() if "lora_" in n}
    assert all(torch.equal(before[n], after[n]) for n in before if ".teacher." in n)
    assert any(not torch.equal(before[n], after[n]) for n in before if ".default." in n)
    saved = load_file(str(trainer.run_dir / "peft_adapter" / "adapter_model.safetensors"))
    assert not any("teacher" in key for key in saved)  # the run's adapter is the student's only
    report = json.loads((trainer.run_dir / "report.json").read_text())
    assert report["models"]["teacher"]["mode"] == "shared_base"
    assert report["models"]["teacher"]["adapter_sha256"] is not None


def test_a_student_started_from_an_adapter_continues_from_exactly_its_weights(tmp_path, trained_adapter):
    trainer = trainer_for(tmp_path, "continue", f"model.adapter={trained_adapter}")
    saved = load_file(str(trained_adapter / "adapter_model.safetensors"))
    ours = {n.replace(".default", ""): p for n, p in trainer.student.named_parameters() if "lora_" in n}
    assert saved.keys() == ours.keys()
    assert all(torch.equal(saved[k], ours[k].detach()) for k in saved)
    assert all(p.requires_grad for p in ours.values())


def test_standard_teacher_with_an_adapter_applies_it(tmp_path, trained_adapter):
    # The toy teacher has the student's architecture, so the student's adapter fits it.
    trainer = trainer_for(tmp_path, "std", f"teacher.adapter={trained_adapter}")
    assert any("lora_" in n for n, _ in trainer.teacher.model.named_parameters())
    assert not any(p.requires_grad for p in trainer.teacher.model.parameters())


@pytest.fixture
def broken_adapter(tmp_path, trained_adapter):
    def make(edit):
        folder = tmp_path / "broken"
        shutil.copytree(trained_adapter, folder)
        edit(folder)
        return folder

    return make


def retarget(folder):
    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_modules"] = ["c_attn"]
    (folder / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("setting", ["teacher.mode=shared_base teacher.adapter", "model.adapter"])
def test_an_adapter_for_other_target_modules_is_refused(tmp_path, broken_adapter, setting):
    folder = broken_adapter(retarget)
    overrides = [*setting.split()[:-1], f"{setting.split()[-1]}={folder}"]
    with pytest.raises(MiniverlError, match=r"targets modules \['c_attn'\]"):
        trainer_for(tmp_path, "run", *overrides)


def test_an_adapter_of_another_base_model_is_refused(tmp_path):
    other = trainer_for(tmp_path, "other", "model.toy.hidden_size=32", "model.toy.intermediate_size=64", train=True)
    with pytest.raises(MiniverlError, match="features in this base model but"):
        trainer_for(tmp_path, "run", "teacher.mode=shared_base", f"teacher.adapter={other.run_dir / 'peft_adapter'}")


def test_a_folder_that_is_not_an_adapter_is_refused(tmp_path):
    with pytest.raises(MiniverlError, match="not a PEFT adapter folder"):
        trainer_for(tmp_path, "run", f"model.adapter={tmp_path}")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["teacher.mode=shared_base"], "needs teacher.adapter"),
        (["teacher.mode=ref", "teacher.adapter=/x"], "drop teacher.adapter"),
        (["teacher.mode=self"], "choose one of standard, ref, shared_base"),
    ],
)
def test_inconsistent_teacher_settings_are_refused_at_composition(overrides, message):
    with pytest.raises(MiniverlError, match=message):
        to_config(compose_config(["+recipe=opd_k1", "model=toy", "teacher=toy", *overrides]))


def test_several_teachers_take_the_held_out_rows_contexts_each_its_own():
    """The held-out probe's router: each teacher with its own context prompts of the held-out rows, a teacher
    without a context with none, the training router untouched (a tests audit: contexts were tested with one
    teacher only, and a router that kept the training rows' prompts passed)."""
    from miniverl.workers.teacher import TeacherRouter, TeacherWorker

    def worker(prompts):
        w = TeacherWorker.__new__(TeacherWorker)  # the routing alone: no model
        w.context_prompts = prompts
        return w

    training = TeacherRouter({"a": worker({0: [9]}), "b": worker(None)})
    held = training.for_prompts({"a": {0: [1, 2], 1: [3]}})
    assert held.names == ["a", "b"]
    assert held.workers["a"].context_prompts == {0: [1, 2], 1: [3]} and held.workers["b"].context_prompts is None
    assert training.workers["a"].context_prompts == {0: [9]}
