"""The console: the progress bar shows where a run stands when it stops early and when it resumes."""

from __future__ import annotations

from miniverl.main import run

from conftest import SHORT, compose_config


def _bar_states(stderr: str) -> list[str]:
    return [s.split("|")[2].split()[0] for s in stderr.replace("\r", "\n").splitlines() if s.startswith("opd:")]


def test_the_bar_stops_where_the_run_stopped_and_a_resume_starts_there(tmp_path, capsys):
    args = ["+recipe=opd_k1", *SHORT, "recipe.optimizer_updates=4", "trainer.progress_bar=true"]
    stopped = tmp_path / "stopped"
    assert run(compose_config([*args, "trainer.stop_after_updates=2"]), stopped)["status"] == "interrupted"
    states = _bar_states(capsys.readouterr().err)
    assert states[0] == "0/4" and states[-1] == "2/4"
    run(compose_config([*args, f"trainer.resume_from={stopped}"]), tmp_path / "resumed")
    states = _bar_states(capsys.readouterr().err)
    assert states[0] == "2/4" and states[-1] == "4/4"
