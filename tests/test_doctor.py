"""`python -m miniverl.doctor --out DIR`: the folder it builds in is never a training run's or an export's."""

from __future__ import annotations

import sys

import pytest

from miniverl import doctor

from conftest import run_as_command


def doctor_status(monkeypatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["miniverl/doctor.py", *argv])
    with pytest.raises(SystemExit) as done:
        doctor.main()
    return done.value.code


@pytest.mark.parametrize("held", ["report.json", "checkpoints/update_1/state.json", "verl/overrides.txt"])
def test_a_training_run_or_an_export_is_refused_as_the_doctors_out_before_anything_is_written(
    held, tmp_path, monkeypatch, capsys
):
    """A new-user audit followed the refusal's own hint, trainer.overwrite=true, with --out a finished run's
    folder: the doctor passed 5/5 and the run's checkpoints, adapter, report and metrics were gone."""
    (tmp_path / held).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / held).write_text("kept\n")
    argv = ["+recipe=opd_k1", "model=toy", "teacher=toy", "trainer.overwrite=true", "--out", str(tmp_path)]
    assert doctor_status(monkeypatch, *argv) == 2
    name = held.split("/")[0]
    assert capsys.readouterr().err.strip() == (
        f"miniverl: error: --out {tmp_path} holds a training run's or an export's files ({name}): the doctor never "
        "replaces them; give a new or empty folder"
    )
    assert (tmp_path / held).read_text() == "kept\n" and not (tmp_path / ".hydra").exists()


def test_an_out_that_cannot_be_a_folder_is_one_line_naming_out(tmp_path, monkeypatch, capsys):
    """It said "choose another hydra.run.dir", a setting the user never gave, or was Hydra's traceback."""
    (tmp_path / "file").write_text("x")
    for out, said in ((tmp_path / "file", "is a file, not a folder"), ("/sys/miniverl-doctor", "cannot write")):
        assert doctor_status(monkeypatch, "+recipe=opd_k1", f"--out={out}") == 2  # --out=DIR as --out DIR
        err = capsys.readouterr().err.strip()
        assert said in err and err.endswith("choose another --out") and "\n" not in err


def test_a_sweep_command_is_refused_in_one_line(monkeypatch, capsys):
    """A config audit pasted a sweep: argparse's usage block and "unrecognized arguments" whatever the order."""
    assert doctor_status(monkeypatch, "-m", "+recipe=opd_k1", "model=toy", "teacher=toy", "estimator=k1,k3") == 2
    assert capsys.readouterr().err.strip() == (
        "miniverl: error: the doctor checks one command, not a sweep: drop -m and give each key one value"
    )


def test_a_recipe_of_ones_own_is_found_through_config_dir(tmp_path, capsys):
    """The doctor put its own overrides before the user's arguments, where Hydra's parser refuses --config-dir."""
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - /recipe/opd_k1\n  - _self_\nrecipe:\n  prompt_limit: 100\n"
    )
    argv = [f"--config-dir={tmp_path / 'conf'}", "+recipe=mine", "model=toy", "teacher=toy"]
    assert run_as_command("doctor", *argv, "--out", str(tmp_path / "out")) == 0
    assert "(limit 100)" in capsys.readouterr().out  # the recipe of ones own
    # and a flag after the overrides, where the doctor's own overrides once followed it
    assert run_as_command("doctor", *argv, "--cfg", "job") == 0
    assert "prompt_limit: 100" in capsys.readouterr().out
