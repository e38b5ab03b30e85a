"""report.json's `models` block: the config blocks as the run loaded them (LoRA on, the revision a local
folder was not loaded at, toy settings only for a toy) and the loss's teacher target."""

from __future__ import annotations

from miniverl.trainer.report_models import student_block, teachers_block

from conftest import compose_config


def test_the_reports_student_block_says_lora_is_on_and_the_teacher_target_follows_the_loss():
    """Two reference-report fields that are no config keys: models.student.lora.enabled (miniverl
    trains LoRA adapters only) and recipe.teacher_target (what the loss needs from the teacher)."""
    from miniverl.config import to_config

    for mode, target in (
        ("k1", "sampled_token_log_probability"),
        ("reverse_kl_full", "full_vocabulary_log_probabilities"),
    ):
        cfg = to_config(compose_config(["+recipe=opd_k1", "model=toy", "teacher=toy", f"estimator={mode}"]))
        block = student_block(cfg)
        assert list(block["lora"])[0] == "enabled" and block["lora"]["enabled"] is True
        assert block["lora"]["r"] == cfg.model.lora.r and block["adapter_sha256"] is None
        assert cfg.estimator.teacher_target == target


def test_the_report_records_no_hub_revision_for_a_model_loaded_from_a_local_folder(tmp_path):
    """opd_k1 pins Qwen3's hub commits; a user's own folder in their place is loaded at no revision,
    so the report must not name Qwen3's commit for it. A hub id keeps its pin."""
    from miniverl.config import to_config

    folder = tmp_path / "my-model"
    folder.mkdir()
    local = to_config(compose_config(["+recipe=opd_k1", f"model.model_id={folder}", f"teacher.model_id={folder}"]))
    assert local.model.revision  # the config as given: the plan and the resume identity are unchanged
    assert student_block(local)["revision"] is None
    assert teachers_block(local, {})["teacher"]["revision"] is None
    hub = to_config(compose_config(["+recipe=opd_k1"]))
    assert student_block(hub)["revision"] == hub.model.revision == "c1899de289a04d12100db370d81485cdf75e47ca"
    assert teachers_block(hub, {})["teacher"]["revision"] == hub.teacher.revision


def test_a_model_block_carries_toy_settings_only_where_the_model_is_a_toy(tmp_path):
    """report.json listed the toy's hidden size and layers under a real model's block, read as that model's."""
    from miniverl.config import to_config

    folder = tmp_path / "my-model"
    folder.mkdir()
    cfg = to_config(compose_config(["+recipe=opd_k1", f"model.model_id={folder}", "teacher=toy"]))
    assert "toy" not in student_block(cfg)
    assert teachers_block(cfg, {})["teacher"]["toy"]["hidden_size"] == cfg.teacher.toy.hidden_size


def test_a_student_started_from_an_adapter_reports_that_adapters_lora_not_model_lora(tmp_path):
    """A new-user audit's report said r=16 on all-linear for a run that trained an r8 q/v adapter."""
    import json

    from miniverl.config import to_config

    (tmp_path / "adapter").mkdir()
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none",
              "target_modules": ["v_proj", "q_proj"]}  # fmt: skip
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"")  # its sha256 is reported too
    cfg = to_config(compose_config(["+recipe=opd_k1_real_cpu", f"model.adapter={tmp_path / 'adapter'}"]))
    assert cfg.model.lora.r == 16 and cfg.model.lora.target_modules == "all-linear"  # the recipe's, not read
    assert student_block(cfg)["lora"] == {
        "enabled": True, "r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none"
    }  # fmt: skip


def test_a_teacher_of_the_students_base_reports_the_students_model_not_its_unread_block():
    """A new-user audit's report named SmolLM2-135M (the preset's teacher) for a teacher.mode=ref run on its own
    Llama: the block's model_id and quantization are not read in that mode."""
    from miniverl.config import to_config

    cfg = to_config(compose_config(["+recipe=opd_k1_real_cpu", "teacher.mode=ref", "teacher.quantization=none"]))
    teacher, student = teachers_block(cfg, {})["teacher"], student_block(cfg)
    assert teacher["mode"] == "ref" and teacher["model_id"] == student["model_id"] == cfg.model.model_id
    assert teacher["quantization"] == student["quantization"] == "nf4" and "toy" not in teacher
    standard = teachers_block(to_config(compose_config(["+recipe=opd_k1_real_cpu"])), {})["teacher"]
    assert standard["model_id"] != cfg.model.model_id  # its own teacher
