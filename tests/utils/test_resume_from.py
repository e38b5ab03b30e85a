"""Which checkpoint a resume names: a refused folder says what it is and the way on."""

from __future__ import annotations

import pytest

from miniverl.utils import resume_from
from miniverl.utils.errors import MiniverlError


def test_resume_from_a_missing_or_empty_folder_says_which_and_what_to_give(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MiniverlError) as refused:
        resume_from.resolve_checkpoint("outputs/nope")
    assert str(refused.value) == (
        f"trainer.resume_from=outputs/nope: no such folder (relative to {tmp_path}); give the run folder of the "
        "stopped run (outputs/<date>/<time>) or one of its checkpoints/update_<k>/"
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(MiniverlError, match=r"^trainer.resume_from=empty: neither a checkpoint folder"):
        resume_from.resolve_checkpoint("empty")
    (tmp_path / "empty" / "plan.json").write_text("{}")  # a run killed in update 1, before its first checkpoint
    with pytest.raises(MiniverlError) as refused:
        resume_from.resolve_checkpoint("empty")
    assert str(refused.value) == (
        "trainer.resume_from=empty: that run stopped before its first checkpoint, so nothing is left to resume; run "
        "the command that started it again (with hydra.run.dir=empty it starts again in that folder, from where that "
        "command started)"
    )
    (tmp_path / "empty" / "report.json").write_text('{"status": "interrupted"}')  # stopped, checkpoints/ removed
    with pytest.raises(MiniverlError) as refused:
        resume_from.resolve_checkpoint("empty")
    assert str(refused.value) == (
        "trainer.resume_from=empty: that run's checkpoints/ is gone (removed or moved), so nothing is left to "
        "resume; start the run anew: in another hydra.run.dir, or in empty with trainer.overwrite=true"
    )


def test_a_run_folder_means_its_newest_checkpoint_by_update_number(tmp_path):
    """update_10 after update_2, whatever their names sort as (a tests audit: the oldest passed, caught only by
    a slow e2e test)."""
    from miniverl.utils.resume_from import resolve_checkpoint

    for update in (1, 2, 10):
        folder = tmp_path / "checkpoints" / f"update_{update}"
        folder.mkdir(parents=True)
        (folder / "state.json").write_text("{}")
    assert resolve_checkpoint(tmp_path) == tmp_path / "checkpoints" / "update_10"
    assert resolve_checkpoint(tmp_path / "checkpoints" / "update_2") == tmp_path / "checkpoints" / "update_2"
