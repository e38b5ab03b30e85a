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
