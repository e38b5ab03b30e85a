"""The run folder: what a run finds there before it writes is never replaced unasked."""

from __future__ import annotations

from pathlib import Path

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


def _write_many(path: str, tag: bytes) -> None:
    from miniverl.utils.run_folder import atomic_write_bytes

    for _ in range(300):
        atomic_write_bytes(Path(path), tag * 1000)


def test_two_processes_writing_one_file_atomically_do_not_trip_over_each_others_temporary_file(tmp_path):
    """A parallel sweep's jobs each rewrite the sweep summary: with one temporary name for both, one renamed
    the other's file away (a new-user audit: FileNotFoundError on .sweep_summary.png.tmp, 1 try in 2)."""
    import multiprocessing

    target = tmp_path / "sweep_summary.md"
    # fork: the writers start at once, without a spawned interpreter's imports (~5 s each); they only write files
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    writers = [context.Process(target=_write_many, args=(str(target), tag)) for tag in (b"a", b"b")]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
    assert [writer.exitcode for writer in writers] == [0, 0]
    assert target.read_bytes() in (b"a" * 1000, b"b" * 1000)
    assert [p.name for p in tmp_path.iterdir()] == ["sweep_summary.md"]  # no temporary file left behind
