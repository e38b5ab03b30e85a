"""The run folder: what a run finds there before it writes is never replaced unasked."""

from __future__ import annotations

import pytest

from miniverl.utils.errors import MiniverlError
from miniverl.utils.run_folder import RunFolder


def test_files_a_run_would_replace_in_a_folder_without_a_run_are_refused_untouched(tmp_path):
    (tmp_path / "report.md").write_text("my notes on last week's run\n")
    (tmp_path / "peft_adapter").mkdir()
    (tmp_path / "peft_adapter" / "adapter_config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("kept\n")
    with pytest.raises(MiniverlError) as refused:
        RunFolder(tmp_path)
    assert str(refused.value) == (
        f"run folder {tmp_path} holds report.md, peft_adapter but no run of miniverl's (no metrics.jsonl, "
        "report.json, plan.json): a run here would replace them; choose another hydra.run.dir, or replace them "
        "with trainer.overwrite=true"
    )
    assert (tmp_path / "report.md").read_text() == "my notes on last week's run\n"
    assert (tmp_path / "peft_adapter" / "adapter_config.json").is_file()

    assert RunFolder(tmp_path, overwrite=True).fresh  # asked: they go (a foreign checkpoint would pass for the run's)
    assert not (tmp_path / "report.md").exists() and not (tmp_path / "peft_adapter").exists()
    assert (tmp_path / "notes.txt").read_text() == "kept\n"  # a name no run writes


def test_empty_folders_a_failed_start_left_are_no_ones_files(tmp_path):
    (tmp_path / "trajectories").mkdir()
    (tmp_path / "checkpoints").mkdir()
    assert RunFolder(tmp_path).fresh
