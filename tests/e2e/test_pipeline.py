"""A toy end-to-end run through the trainer: it trains what it should, freezes what it should,
and every stored number lines up with an independent recomputation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from miniverl.config import to_config
from miniverl.models import loading as models
from miniverl.trainer.opd_trainer import OPDTrainer
from miniverl.utils.identity import resolved_config

from conftest import ROOT, SHORT, compose_config

VERL_METRICS = [
    "actor/distillation/loss",
    "actor/distillation/abs_loss",
    "actor/distillation/pg_clipfrac",
    "actor/distillation/ppo_kl",
    "actor/grad_norm",
    "response_length/mean",
    "timing_s/gen",
    "timing_s/teacher",
    "timing_s/update_actor",
    "training/rollout_probs_diff_max",
]


def snapshot(module: torch.nn.Module, *, trainable: bool) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (NF4 bytes included) that is / is not trainable."""
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad == trainable}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    import os

    os.chdir(ROOT)
    cfg = compose_config(["+recipe=opd_k1", *SHORT, "actor.optim.lr=1e-3"])
    run_dir = tmp_path_factory.mktemp("run")
    trainer = OPDTrainer(to_config(cfg), resolved_config(cfg), run_dir)
    trainer.setup()
    before = {
        "lora": snapshot(trainer.student, trainable=True),
        "base": snapshot(trainer.student, trainable=False),
        "teacher": {k: v.clone() for k, v in trainer.teacher.model.state_dict().items()},
    }
    trainer.train()
    report = trainer.finish()
    return trainer, before, report, run_dir


def trajectory(run_dir, update):
    return load_file(str(run_dir / "trajectories" / f"update_{update:06d}.safetensors"))


def test_run_writes_every_output(finished_run):
    trainer, _, report, run_dir = finished_run
    for name in (
        "resolved_config.yaml",
        "plan.json",
        "metrics.jsonl",
        "report.json",
        "peft_adapter/adapter_config.json",
        "peft_adapter/adapter_model.safetensors",
    ):
        assert (run_dir / name).is_file(), name
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["training/global_step"] for m in lines] == [1, 2, 3]
    for metrics in lines:
        assert set(VERL_METRICS) <= set(metrics)
        assert math.isfinite(metrics["actor/distillation/loss"])
        assert metrics["actor/loss"] == metrics["actor/distillation/loss"]  # no task loss: verl's coefficient unread
        assert metrics["training/epoch"] == 0  # 3 updates of 4 prompts, one pass over the 64
    assert report["status"] == "measured"
    assert set(report) >= {"recipe", "models", "hardware", "measurements", "artifacts"}
    assert report["recipe"]["compiled_plan_sha256"] == trainer.plan.digest
    assert set(report["measurements"]["steady_state_median_seconds"]) == {"rollout", "teacher_scoring", "actor_update"}


def test_lora_weights_change_and_base_and_teacher_do_not(finished_run):
    trainer, before, _, _ = finished_run
    after_lora = snapshot(trainer.student, trainable=True)
    assert before["lora"] and all("lora_" in n for n in before["lora"])
    assert any(not torch.equal(before["lora"][n], after_lora[n]) for n in after_lora)
    after_base = snapshot(trainer.student, trainable=False)
    assert before["base"].keys() == after_base.keys()
    assert all(torch.equal(before["base"][n], after_base[n]) for n in after_base)
    after_teacher = trainer.teacher.model.state_dict()
    assert all(torch.equal(before["teacher"][n], after_teacher[n]) for n in before["teacher"])


def test_teacher_log_probs_equal_an_independent_plain_forward(finished_run):
    _, _, _, run_dir = finished_run
    teacher = AutoModelForCausalLM.from_pretrained(
        run_dir / "toy_models" / "teacher",
        quantization_config=models.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        ),
        dtype=torch.float32,
        device_map={"": "cpu"},
    )
    models.disable_cpu_nf4_repack(teacher)
    for update in (1, 3):
        t = trajectory(run_dir, update)
        with torch.no_grad():
            logits = teacher(
                input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"]
            ).logits.float()  # (B, L, V)
        P, R = t["prompts"].shape[1], t["responses"].shape[1]
        full = logits[:, P - 1 : P - 1 + R].log_softmax(-1).gather(-1, t["responses"][..., None]).squeeze(-1)
        mask = t["response_mask"]
        torch.testing.assert_close(t["teacher_logprobs"], full * mask, atol=1e-5, rtol=1e-5)


def test_stored_advantage_is_teacher_minus_old_log_prob(finished_run):
    _, _, _, run_dir = finished_run
    t = trajectory(run_dir, 2)
    expected = ((t["teacher_logprobs"] - t["old_log_probs"]).clamp(-10, 10)) * t["response_mask"]
    torch.testing.assert_close(t["advantages"], expected, atol=1e-6, rtol=0)
    assert t["response_mask"].sum() > 0


def test_rollout_log_probs_equal_the_actors_recomputation(finished_run):
    _, _, _, run_dir = finished_run
    for update in (1, 2, 3):
        t = trajectory(run_dir, update)
        torch.testing.assert_close(t["rollout_log_probs"], t["old_log_probs"], atol=1e-5, rtol=1e-5)


def test_response_mask_covers_tokens_up_to_and_including_eos(finished_run):
    trainer, _, _, run_dir = finished_run
    eos, pad = trainer.tokenizer.eos_token_id, trainer.tokenizer.pad_token_id
    for update in (1, 2, 3):
        t = trajectory(run_dir, update)
        for row, mask in zip(t["responses"], t["response_mask"]):
            n = int(mask.sum())
            assert mask[:n].eq(1).all() and mask[n:].eq(0).all()
            assert (row[: n - 1] != eos).all()  # no EOS before the last masked token
            assert row[n - 1] == eos or n == t["responses"].shape[1]
            assert row[n:].eq(pad).all()


def test_peft_adapter_is_a_standard_peft_folder(finished_run):
    trainer, _, _, run_dir = finished_run
    config = json.loads((run_dir / "peft_adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 16 and set(config["target_modules"]) == {"q_proj", "v_proj"}
    assert config["lora_alpha"] == 32 and config["lora_dropout"] == 0.0  # model.lora.alpha, .dropout
    base = AutoModelForCausalLM.from_pretrained(run_dir / "toy_models" / "student", dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, run_dir / "peft_adapter")
    ours = {n: p for n, p in trainer.student.named_parameters() if "lora_" in n}
    theirs = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n].detach(), theirs[n].detach()) for n in ours)
