"""report.json's `models` block: the config blocks as the run loaded them (LoRA on, the revision a local
folder was not loaded at, toy settings only for a toy) and the loss's teacher target."""

from __future__ import annotations

from miniverl.config.recipe import teacher_target_for
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
        assert teacher_target_for(cfg.estimator.loss_mode) == target


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
