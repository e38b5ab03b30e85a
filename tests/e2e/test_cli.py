"""The command a user types: `python -m miniverl.main +recipe=opd_k1 ...`, as a subprocess."""

from __future__ import annotations

import json

import pytest

from conftest import RECIPE_RUN as TOY
from conftest import ROOT, main


@pytest.fixture
def toy_run(recipe_run):
    return recipe_run


def test_the_toy_recipe_runs_from_the_command_line(toy_run):
    result, run_dir = toy_run
    assert result.returncode == 0, result.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "measured" and report["recipe"]["optimizer_updates"] == 3
    assert report["models"]["student"]["model_id"] == "toy"
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3


def test_the_recipe_checks_its_own_exact_resume(toy_run):
    result, run_dir = toy_run
    resume = json.loads((run_dir / "report.json").read_text())["resume"]
    reference = json.loads((ROOT / "recipes/opd_k1/reference-report-rtx4080.json").read_text())["resume"]
    assert set(reference) <= set(resume)
    assert resume["status"] == "exact_match" and resume["first_difference"] is None
    assert resume["adapter_and_optimizer_byte_identical"] and resume["trajectories_byte_identical"]
    assert resume["training_state_fields_identical"]
    assert resume["global_optimizer_steps"] == 3 and resume["task_cursor"] == 12
    assert resume["excluded_run_identity_field"] == "resolved_config_digest"
    assert resume["interrupt_checkpoint_bytes"] > 0 and resume["resume_load_seconds"] >= 0
    # The resumed run's own report says it resumed from the interrupted run's checkpoint at update 1.
    assert resume["resumed_from_checkpoint"] == str(
        run_dir / "resume_check" / "interrupted" / "checkpoints" / "update_1"
    )
    assert resume["resumed_after_update"] == 1
    assert (run_dir / "resume_check" / "interrupted" / "checkpoints" / "update_1").is_dir()


def test_a_finished_run_folder_is_never_overwritten(toy_run):
    _, run_dir = toy_run
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and ".hydra" not in p.parts}
    again = main(*TOY, f"hydra.run.dir={run_dir}")
    assert again.returncode == 2
    assert "already holds a finished run" in again.stderr and "Traceback" not in again.stderr
    assert all(p.read_bytes() == data for p, data in before.items())


def test_a_typo_fails_with_hydras_message():
    result = main("+recipe=opd_k1", "model=toy", "teacher=toy", "recipe.logical_btch=2")
    assert result.returncode != 0
    assert "Could not override 'recipe.logical_btch'" in result.stderr


def test_missing_weights_are_one_line_without_traceback(tmp_path):
    result = main("+recipe=opd_k1", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("miniverl: error: model.model_id=Qwen/Qwen3-0.6B at revision c1899de")
    assert "model=toy teacher=toy" in lines[-1] and "Traceback" not in result.stderr


def test_a_combination_verl_refuses_is_one_line(tmp_path):
    result = main(*TOY, "estimator.use_policy_gradient=false", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert "miniverl: error: estimator: loss_mode=k1 with use_policy_gradient=false is refused" in result.stderr
    assert "Traceback" not in result.stderr
