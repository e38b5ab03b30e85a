"""trainer.logger's trackers: wandb gets every update's metrics under verl's names at its update number
(the values metrics.jsonl holds), a run resumed in its folder goes on in the same W&B run, the resume
check's runs make none, and a tracker that cannot start is one line. wandb runs offline here: no
account, no network (WANDB_MODE=offline, a mode wandb documents)."""

from __future__ import annotations

import json
import sys

import pytest

from miniverl.config.trainer import TrainerConfig
from miniverl.trainer.runner import run
from miniverl.utils.errors import MiniverlError
from miniverl.utils.run_names import METRICS, WANDB, WANDB_RUN_ID
from miniverl.utils.tracking import Tracking

from conftest import SHORT, compose_config, main

wandb = pytest.importorskip("wandb")
WANDB_RUN = ["+recipe=opd_k1", *SHORT, "trainer.logger=[console,jsonl,wandb]", "trainer.project_name=opd-tests"]


@pytest.fixture
def wandb_calls(monkeypatch):
    """What miniverl hands wandb: each init's arguments and each log's (data, step), wandb running as it is."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    calls = {"init": [], "log": [], "finish": []}
    init, log, finish = wandb.init, wandb.Run.log, wandb.Run.finish

    def recording_init(*args, **kwargs):
        calls["init"].append(kwargs)
        return init(*args, **kwargs)

    def recording_log(self, data, step=None, **kwargs):
        calls["log"].append((dict(data), step))
        return log(self, data, step=step, **kwargs)

    def recording_finish(self, exit_code=None, **kwargs):
        calls["finish"].append(exit_code)
        return finish(self, exit_code=exit_code, **kwargs)

    monkeypatch.setattr(wandb, "init", recording_init)
    monkeypatch.setattr(wandb.Run, "log", recording_log)
    monkeypatch.setattr(wandb.Run, "finish", recording_finish)
    return calls


def numeric(metrics: dict) -> dict:
    return {key: value for key, value in metrics.items() if isinstance(value, (int, float))}


def offline_run_ids(run_dir) -> list[str]:
    """The W&B run id of each offline run wandb wrote there: offline-run-<date>_<time>-<id>, and -<n> after it
    where two processes of one run start in the same second."""
    return sorted(path.name.split("-")[3] for path in (run_dir / WANDB).glob("offline-run-*"))


@pytest.mark.slow  # the resume check's two runs are fresh processes
def test_wandb_gets_every_updates_metrics_at_its_update_number_and_the_resume_checks_runs_make_no_wandb_run(
    tmp_path, wandb_calls
):
    run_dir, overrides = tmp_path / "run", [*WANDB_RUN, "recipe.interrupt_after_updates=1"]
    run(compose_config(overrides), run_dir, overrides)  # the overrides: the check's runs are this command's
    lines = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]
    assert [step for _, step in wandb_calls["log"]] == [1, 2, 3]
    assert [data for data, _ in wandb_calls["log"]] == [numeric(line) for line in lines]
    assert "actor/distillation/loss" in wandb_calls["log"][0][0] and "timing_s/gen" in wandb_calls["log"][0][0]
    (init,) = wandb_calls["init"]  # the check's runs are other processes: their wandb is off (WANDB_MODE)
    assert wandb_calls["finish"] == [0]  # once, though the report is written again with the check's verdict
    assert init["project"] == "opd-tests" and init["name"] == "opd_k1"  # trainer.project_name, experiment_name
    assert init["config"]["trainer"]["logger"] == ["console", "jsonl", "wandb"]  # the resolved config
    assert init["config"]["recipe"]["optimizer_updates"] == 3
    assert offline_run_ids(run_dir) == [(run_dir / WANDB_RUN_ID).read_text().strip()] == [init["id"]]
    twins = [run_dir / "resume_check" / "interrupted", run_dir / "resume_check" / "resumed"]
    assert all((twin / METRICS).is_file() for twin in twins)  # they ran, with the same trainer.logger
    assert not any((twin / WANDB).exists() for twin in twins)


def test_a_run_resumed_in_its_folder_goes_on_in_the_same_wandb_run_and_a_replaced_one_starts_another(
    tmp_path, wandb_calls
):
    run_dir = tmp_path / "run"
    run(compose_config([*WANDB_RUN, "trainer.stop_after_updates=1"]), run_dir)
    first = (run_dir / WANDB_RUN_ID).read_text().strip()
    run(compose_config(WANDB_RUN), run_dir)  # resume_mode auto: from the folder's checkpoint of update 1
    assert [step for _, step in wandb_calls["log"]] == [1, 2, 3]  # the resumed process logs updates 2 and 3
    assert [init["id"] for init in wandb_calls["init"]] == [first, first]
    assert wandb_calls["finish"] == [0, 0]  # the stop's process and the resumed one each close their W&B run
    assert offline_run_ids(run_dir) == [first, first]  # two processes, one W&B run (`wandb sync` joins them)
    run(compose_config([*WANDB_RUN, "trainer.overwrite=true"]), run_dir)
    assert wandb_calls["init"][-1]["id"] != first  # another run, whose steps would collide with the first's
    assert offline_run_ids(run_dir) == [wandb_calls["init"][-1]["id"]]  # the old run's files went with it


def test_a_tracker_that_is_not_installed_is_refused_in_one_line_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(MiniverlError) as refused:
        Tracking(TrainerConfig(logger=["console", "wandb"]), tmp_path)
    assert str(refused.value) == (
        "trainer.logger includes wandb, which is not installed: pip install -e '.[wandb]' (or drop it from "
        "trainer.logger)"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_wandb_without_an_account_is_one_line_saying_how_to_log_in_or_run_offline(tmp_path):
    env = {"HOME": str(tmp_path / "home"), "WANDB_MODE": "online", "WANDB_API_KEY": "", "WANDB_SILENT": "true"}
    command = ["+recipe=opd_k1", *SHORT, "trainer.logger=[console,wandb]", f"hydra.run.dir={tmp_path / 'run'}"]
    done = main(*command, env=env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "miniverl: error: wandb could not start a run: No API key configured. Use `wandb login` to log in; run "
        "`wandb login`, or set WANDB_MODE=offline (and `wandb sync` later), or drop wandb from trainer.logger"
    )
    # A docs audit: the refused run left its plan.json and the rest in the folder. Taken back, as a set-up that fails.
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".hydra", "main.log"]  # free for the fix


def test_a_failed_run_closes_its_wandb_run_as_failed_and_the_held_out_metrics_reach_it(
    tmp_path, wandb_calls, monkeypatch
):
    from miniverl.workers.teacher import TeacherWorker

    heldout = ["data.val_files=[data/toy_prompts_heldout.parquet]", "eval.every=1"]
    run_dir = tmp_path / "probed"
    run(compose_config([*WANDB_RUN, *heldout]), run_dir)
    lines = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]
    assert any(key.startswith("val/") for key in lines[-1])
    logged: dict[int, dict] = {}
    for data, step in wandb_calls["log"]:  # the probe before update 1 is logged at step 0
        logged.setdefault(step, {}).update(data)
    assert [logged[line["training/global_step"]] for line in lines] == [numeric(line) for line in lines]

    real, calls = TeacherWorker.compute_teacher_log_prob, []

    def nan_in_update_2(self, batch, *args, **kwargs):
        batch = real(self, batch, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            batch.teacher_logprobs = batch.teacher_logprobs * float("nan")
        return batch

    monkeypatch.setattr(TeacherWorker, "compute_teacher_log_prob", nan_in_update_2)
    with pytest.raises(MiniverlError, match="update 2 failed"):
        run(compose_config(WANDB_RUN), tmp_path / "failed")
    assert wandb_calls["finish"] == [0, 1]


def test_wandbs_refusal_is_its_first_line_and_a_run_not_resumed_here_gets_a_new_wandb_run(tmp_path, monkeypatch):
    from miniverl.utils.tracking import WandbLogger

    def refusing(*args, **kwargs):
        raise wandb.errors.CommError("Could not reach the server.\nRetry in 30 s")

    monkeypatch.setattr(wandb, "init", refusing)
    with pytest.raises(MiniverlError) as refused:
        WandbLogger(tmp_path).start("p", "n", {}, continuing=False)
    assert str(refused.value).startswith("wandb could not start a run: Could not reach the server; run `wandb login`")
    ids = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: ids.append(kwargs["id"]) or object())
    (tmp_path / WANDB_RUN_ID).write_text("abcd1234\n")
    WandbLogger(tmp_path).start("p", "n", {}, continuing=True)
    WandbLogger(tmp_path).start("p", "n", {}, continuing=False)
    assert ids[0] == "abcd1234" and ids[1] != "abcd1234"
