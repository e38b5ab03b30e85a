"""Bad input, faults and interruptions: one clear line, nothing lost, and exact resume after a
signal. (Missing weights, typos, foreign tokenizers, broken checkpoints and occupied run folders
are tested beside their features: test_models, test_cli, test_doctor, test_resume.)"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError

from miniverl.config import to_config
from miniverl.config.data import DataConfig
from miniverl.models import loading as models_loading
from miniverl.trainer.opd_trainer import OPDTrainer
from miniverl.trainer.resume_check import first_difference
from miniverl.trainer.runner import run
from miniverl.utils import checkpoint, resume_from
from miniverl.utils.dataset import read_conversations
from miniverl.utils.errors import MiniverlError, RunStopped
from miniverl.utils.identity import canonical_json, sha256_json

from conftest import RECIPE_RUN, ROOT, SHORT, compose_config, run_as_command

BASE = ["+recipe=opd_k1", *SHORT]


def run_toy(run_dir, *extra):
    return run(compose_config([*BASE, *extra]), run_dir)


def prompts_table(prompts):
    return pa.table({"prompt": pa.array(prompts)})


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.write_text("not,a,parquet\n1,2,3\n"), "is not a readable parquet file"),
        (lambda p: pq.write_table(pa.table({"question": ["2+2?"]}), p), "has no column 'prompt'"),
        (
            lambda p: pq.write_table(pa.table({"prompt": [12, 7]}), p),
            "row 0 column 'prompt': expected a list of {role, content} messages",
        ),
        (
            lambda p: pq.write_table(prompts_table([[{"role": "user", "content": "hi"}], [{"role": "user"}]]), p),
            "row 1 column 'prompt': expected a list of {role, content} messages",
        ),
        (lambda p: pq.write_table(pa.table({"prompt": pa.array([], type=pa.string())}), p), "holds no rows"),
        (
            lambda p: pq.write_table(prompts_table([[{"role": "user", "content": f"q{i}"}] for i in range(5)]), p),
            r"the plan consumes 12 prompts from 5 usable ones .* data.repeat_prompts=true",
        ),
    ],
)
@pytest.mark.slow
def test_bad_train_files_are_one_line_naming_the_file_and_the_fix(tmp_path, make, message):
    path = tmp_path / "prompts.parquet"
    make(path)
    with pytest.raises(MiniverlError, match=message) as info:
        run_toy(tmp_path / "run", f"data.train_files={path}")
    assert "\n" not in str(info.value)
    assert "data.train_files" in str(info.value) or "data:" in str(info.value)


@pytest.mark.slow
def test_a_finished_run_folder_is_replaced_only_when_told(tmp_path):
    run_toy(tmp_path / "run")
    with pytest.raises(MiniverlError, match=r"already holds a run \(status measured: .* trainer.overwrite=true"):
        run_toy(tmp_path / "run", "trainer.resume_mode=disable")
    report = run_toy(tmp_path / "run", "trainer.overwrite=true", "recipe.optimizer_updates=2")
    assert report["status"] == "measured" and report["recipe"]["optimizer_updates"] == 2
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    assert [p.name for p in checkpoint.checkpoints_in(tmp_path / "run")] == ["update_1", "update_2"]


@pytest.mark.slow
def test_an_overwrite_that_would_remove_the_runs_own_input_is_refused_before_anything_goes(tmp_path):
    """A new-user audit continued from a run's adapter in that run's own folder with trainer.overwrite=true:
    the folder was emptied first, the adapter then "not a PEFT adapter folder", the earlier run lost."""
    run_toy(tmp_path / "run", "recipe.optimizer_updates=2")
    adapter = tmp_path / "run" / "peft_adapter"
    with pytest.raises(MiniverlError) as refused:
        run_toy(tmp_path / "run", f"model.adapter={adapter}", "trainer.overwrite=true")
    assert str(refused.value) == (
        f"trainer.overwrite=true would remove {adapter} from {tmp_path / 'run'} before the run reads it "
        "(model.adapter): copy it out of that folder first, or choose another hydra.run.dir"
    )
    assert (adapter / "adapter_config.json").is_file() and (tmp_path / "run" / "report.json").is_file()


def test_a_read_only_output_folder_is_one_line(tmp_path, monkeypatch):
    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)  # root ignores permission bits, so simulate it
    with pytest.raises(MiniverlError, match="cannot create the run folder .*: Read-only file system"):
        run_toy(tmp_path / "run")


def test_a_run_whose_model_fails_to_load_leaves_its_folder_free_for_the_corrected_command(tmp_path, monkeypatch):
    """A plan.json alone (nothing trained, nothing to resume) once made the next command refuse the
    folder as a run's, and its advice to resume failed too."""

    def broken(*args, **kwargs):
        raise MiniverlError("model.model_id=toy: cannot be loaded (simulated)")

    monkeypatch.setattr(models_loading, "load_student", broken)
    foreign = tmp_path / "run" / "tensorboard" / "from_another_tool.txt"  # what the folder held: left alone
    foreign.parent.mkdir(parents=True)
    foreign.write_text("not miniverl's")
    with pytest.raises(MiniverlError, match="simulated"):
        run_toy(tmp_path / "run")
    assert not (tmp_path / "run" / "plan.json").exists() and foreign.read_text() == "not miniverl's"
    foreign.unlink()
    foreign.parent.rmdir()
    monkeypatch.undo()
    assert run_toy(tmp_path / "run", "recipe.optimizer_updates=2")["status"] == "measured"  # another plan: the fix


def test_a_setup_that_fails_in_its_own_folder_keeps_the_pre_flight_warnings_in_its_main_log(tmp_path, monkeypatch):
    """The pre-flight's WARN lines go to main.log once the folder is the run's; a model that then failed to
    load left only the error line there (the warnings were on the console alone)."""

    def broken(*args, **kwargs):
        raise MiniverlError("model.model_id=toy: cannot be loaded (simulated)")

    monkeypatch.setattr(models_loading, "load_student", broken)
    unread = ["data.val_files=data/toy_prompts_heldout.parquet", "eval.every=-1"]  # a WARN of the data check
    assert run_as_command("main", *BASE, *unread, f"hydra.run.dir={tmp_path / 'run'}") == 2
    log = (tmp_path / "run" / "main.log").read_text()
    assert "pre-flight WARN data:" in log and "data.val_files is not read with eval.every=-1" in log
    assert log.index("pre-flight WARN data:") < log.index("cannot be loaded (simulated)")


# Nobody can create a folder in Linux's /sys, root included (who ignores permission bits): what a
# read-only or foreign location does to a command, before any of miniverl's own code runs.
UNWRITABLE = Path("/sys/miniverl-unwritable")


def write_to_unwritable(command: str, tmp_path: Path) -> int:
    if command == "main":
        return run_as_command("main", *BASE, f"hydra.run.dir={UNWRITABLE / 'run'}")
    if command == "bench":
        from miniverl.bench.cli import main as bench

        return bench(["--losses", "--vocab", "1024", "--out", str(UNWRITABLE / "losses")])
    from miniverl.import_verl import main as import_verl

    launch = tmp_path / "overrides.txt"
    launch.write_text(
        "distillation.enabled=True\ndistillation.teacher_models.teacher_model.model_path=/models/teacher\n"
        "actor_rollout_ref.model.path=/models/student\n"
    )
    return import_verl([str(launch), "-o", str(UNWRITABLE / "overrides.txt")])


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs Linux's /sys")
@pytest.mark.parametrize(
    "command,prefix,fix",
    [
        ("main", "miniverl", "choose another hydra.run.dir (hydra.sweep.dir with -m)"),
        ("bench", "miniverl.bench", "choose another --out"),
        ("import_verl", "miniverl", "choose another -o"),
    ],
)
def test_an_output_folder_that_cannot_be_created_is_one_line_from_the_command(tmp_path, capfd, command, prefix, fix):
    assert write_to_unwritable(command, tmp_path) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{prefix}: error: cannot write {UNWRITABLE}: ") and last.endswith(f"; {fix}")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_run_folder_where_no_folder_can_be_made_is_one_line(capfd):
    """/proc holds no folders a process makes: mkdir says ENOENT, which was a traceback and exit 1 (a docs audit)."""
    assert run_as_command("main", *BASE, "hydra.run.dir=/proc/miniverl-run") == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "miniverl: error: cannot make /proc/miniverl-run: No such file or directory; choose another hydra.run.dir "
        "(hydra.sweep.dir with -m)"
    )


@pytest.mark.parametrize("below", ["", "run"])
def test_a_run_folder_that_is_a_file_or_lies_under_one_is_one_line_naming_the_file(tmp_path, capfd, below):
    """A new-user audit gave hydra.run.dir its data file: Hydra's FileExistsError traceback, exit 1."""
    data = tmp_path / "train.parquet"
    data.write_bytes(b"PAR1")
    assert run_as_command("main", *BASE, f"hydra.run.dir={data / below if below else data}") == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and data.read_bytes() == b"PAR1"
    assert err.strip().splitlines()[-1] == (
        f"miniverl: error: {data} is a file, not a folder: choose another hydra.run.dir (hydra.sweep.dir with -m)"
    )


@pytest.mark.parametrize(
    "command,args,key",
    [
        ("main", ["hydra.run.dir="], "hydra.run.dir"),
        ("main", ["-m", "trainer.seed=1,2", "hydra.sweep.dir="], "hydra.sweep.dir"),
        ("export", ["hydra.run.dir="], "hydra.run.dir"),
    ],
)
def test_an_empty_run_or_sweep_folder_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, capfd, command, args, key
):
    """A new-user audit's `hydra.run.dir=$OUT` with OUT unset wrote the run into the working directory."""
    monkeypatch.chdir(tmp_path)
    assert run_as_command(command, *args, *BASE) == 2
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        f"miniverl: error: {key} is empty (an unset shell variable?): give the folder to write to, "
        f"or leave {key} out for a new dated folder under outputs/"
    )
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_hydras_callbacks_import_is_one_line_not_a_traceback(tmp_path, monkeypatch, capfd):
    """A new-user audit's Ctrl-C 1.5 s after the start: an 89-line KeyboardInterrupt traceback from the
    callback's `import torch`, before miniverl's own handling starts."""
    from miniverl.utils.hydra_entry import KeepEarlierRunRecord

    def interrupted(self, config, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(KeepEarlierRunRecord, "on_run_start", interrupted)
    assert run_as_command("main", *BASE, f"hydra.run.dir={tmp_path / 'run'}") == 130
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "miniverl: error: stopped by SIGINT; run the same command again to go on"


def test_a_run_folder_whose_log_cannot_be_opened_is_one_line(tmp_path, monkeypatch, capfd):
    """A new-user audit resumed in a run folder remounted read-only: logging's "Unable to configure
    handler 'file'" traceback (a new folder there was already one line)."""
    import logging

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "run" / "main.log"))

    monkeypatch.setattr(logging.FileHandler, "__init__", read_only)
    assert run_as_command("main", *BASE, f"hydra.run.dir={tmp_path / 'run'}") == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"miniverl: error: cannot write {tmp_path / 'run' / 'main.log'}: Read-only file system; "
        "choose another hydra.run.dir (hydra.sweep.dir with -m)"
    )
    # A lose-work audit: a stopped run's folder made read-only; a new folder starts afresh unless it is told.
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert run_as_command("main", *BASE, f"hydra.run.dir={tmp_path / 'run'}") == 2
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        f"miniverl: error: cannot write {tmp_path / 'run' / 'main.log'}: Read-only file system; "
        f"choose another hydra.run.dir (hydra.sweep.dir with -m), and add trainer.resume_from={tmp_path / 'run'} "
        "to go on from its checkpoints"
    )


# What a full disk raises: the OS's error, or safetensors' own (its Rust writer reports the OS's as
# text; measured on a 1.2 MB tmpfs, where an unrecognised one used to end in a traceback).
FULL_DISK = {
    "os": lambda path: OSError(errno.ENOSPC, "No space left on device", path),
    "safetensors": lambda path: SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    ),
}


@pytest.mark.parametrize("raised", FULL_DISK)
def test_a_full_disk_keeps_the_last_checkpoint_whole_and_says_how_to_resume(tmp_path, monkeypatch, raised):
    import miniverl.utils.checkpoint as ckpt_module

    real, calls = ckpt_module.save_file, {"n": 0}

    def fills_up(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2:  # adapter + optimizer of update 1 fit; update 2 does not
            raise FULL_DISK[raised](str(args[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt_module, "save_file", fills_up)
    with pytest.raises(MiniverlError, match="No space left on device; the last complete checkpoint is .*update_1") as e:
        run_toy(tmp_path / "run")
    assert str(e.value).endswith(f"then run again with trainer.resume_from={tmp_path / 'run'}")
    plan_digest = json.loads((tmp_path / "run" / "checkpoints" / "update_1" / "state.json").read_text())[
        "compiled_plan_sha256"
    ]
    assert resume_from.verify_checkpoint(tmp_path / "run", plan_digest).update == 1


@pytest.mark.slow
def test_a_run_resumed_at_an_earlier_checkpoint_of_its_folder_keeps_its_own_checkpoints_and_goes_on_exactly(tmp_path):
    """An audit: resumed at update 1 of a run that had reached update 3 (as a damaged newest checkpoint's
    line says to), with one checkpoint kept, the run deleted the checkpoint it had just written and kept
    the earlier run's update 3; its stop line was a FileNotFoundError read as "cannot make"."""
    four, run_dir = ["recipe.optimizer_updates=4"], tmp_path / "run"
    reference = run_toy(tmp_path / "reference", *four)
    run_toy(run_dir, *four, "trainer.stop_after_updates=3", "trainer.max_actor_ckpt_to_keep=null")
    first = run_dir / "checkpoints" / "update_1"
    again = [*four, f"trainer.resume_from={first}", "trainer.max_actor_ckpt_to_keep=1", "trainer.stop_after_updates=2"]
    stopped = run_toy(run_dir, *again)
    assert stopped["status"] == "interrupted"
    assert [c.name for c in checkpoint.checkpoints_in(run_dir)] == ["update_2"]  # its own; the earlier run's 3 went
    resumed = run_toy(run_dir, *four, "trainer.max_actor_ckpt_to_keep=1")  # auto: from update_2, its newest
    for key in ("trajectory_sha256", "standard_peft_adapter_sha256"):
        assert resumed["artifacts"][key] == reference["artifacts"][key]


@pytest.mark.slow
def test_a_ctrl_c_while_the_report_is_written_leaves_a_run_the_same_command_finishes(tmp_path, monkeypatch, capfd):
    """An audit: stopped after its last update while it wrote its report (Ctrl-C, a full disk, a kill), a
    run could never get its report: the same command was refused as a finished run's."""
    from miniverl.trainer import opd_trainer

    run_dir = tmp_path / "run"
    reference = run_toy(tmp_path / "reference")
    run_toy(run_dir, "trainer.stop_after_updates=2")  # its report.json says interrupted: the resumed run's is owed

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the report is written

    monkeypatch.setattr(opd_trainer, "write_report_page", interrupted)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    assert run_as_command("main", *BASE, f"hydra.run.dir={run_dir}") == 130
    last = run_dir / "checkpoints" / "update_3"
    assert capfd.readouterr().err.strip() == (
        "miniverl: error: stopped by SIGINT after the last update, before the run's report was complete; the "
        f"trained run is checkpointed in {last} (adapter.safetensors); run the same command again to write the report"
    )
    monkeypatch.undo()
    assert run_as_command("main", *BASE, f"hydra.run.dir={run_dir}") == 0  # as the line says
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "measured" and (run_dir / "report.md").is_file()
    for key in ("trajectory_sha256", "standard_peft_adapter_sha256"):
        assert report["artifacts"][key] == reference["artifacts"][key]
    assert run_as_command("main", *BASE, f"hydra.run.dir={run_dir}") == 2  # reported now: a finished run
    assert "already holds a finished run" in capfd.readouterr().err


def test_a_second_command_into_a_folder_whose_run_is_going_on_is_refused_before_it_writes(tmp_path):
    """An audit: started into the folder of a run still going on, a second command took it for a run that had
    stopped before its first checkpoint and removed its outputs; both wrote metrics.jsonl."""
    from miniverl.utils.run_folder import RunFolder

    run_dir = tmp_path / "run"
    run_toy(run_dir, "trainer.stop_after_updates=1")  # what the going-on run has written so far
    before = sorted((p.relative_to(run_dir).as_posix(), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    going_on = RunFolder(run_dir, continuing=True)  # its lock, as the first command holds it
    with pytest.raises(MiniverlError) as refused:
        run_toy(run_dir)
    assert str(refused.value) == (
        f"run folder {run_dir} is in use: another miniverl process is running there now; wait until it ends (then "
        "the same command resumes or refuses as usual), or choose another hydra.run.dir"
    )
    assert sorted((p.relative_to(run_dir).as_posix(), p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before
    going_on.release()
    assert run_toy(run_dir)["status"] == "measured"  # resumed once the folder is free
    assert run_toy(tmp_path / "again")["status"] == "measured"  # each run releases its folder when it ends
    assert run_toy(tmp_path / "again", "trainer.overwrite=true")["status"] == "measured"


def test_a_resume_without_the_jsonl_logger_keeps_the_earlier_runs_metrics_lines(tmp_path):
    """An audit: resumed with trainer.logger=[console], a run emptied the metrics.jsonl its first process wrote."""
    run_dir = tmp_path / "run"
    run_toy(run_dir, "trainer.stop_after_updates=2")
    written = (run_dir / "metrics.jsonl").read_text()
    assert len(written.splitlines()) == 2
    assert run_toy(run_dir, "trainer.logger=[console]")["status"] == "measured"  # resumed: update 3, not logged
    assert (run_dir / "metrics.jsonl").read_text() == written
    run_toy(tmp_path / "quiet", "trainer.logger=[console]")
    assert not (tmp_path / "quiet" / "metrics.jsonl").exists()  # nor is one made where none was


def test_a_nan_loss_stops_at_once_keeps_the_last_good_checkpoint_and_reports_failed(tmp_path, monkeypatch):
    from miniverl.workers.teacher import TeacherWorker

    real, calls = TeacherWorker.compute_teacher_log_prob, {"n": 0}

    def nan_on_update_2(self, batch, rows):
        calls["n"] += 1
        batch = real(self, batch, rows)
        if calls["n"] == 2:
            batch.teacher_logprobs = batch.teacher_logprobs * float("nan")
        return batch

    monkeypatch.setattr(TeacherWorker, "compute_teacher_log_prob", nan_on_update_2)
    with pytest.raises(MiniverlError, match="update 2 failed: non-finite loss"):
        run_toy(tmp_path / "run", "trainer.save_freq=-1")
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "failed" and report["failure"]["update"] == 2
    assert [p.name for p in checkpoint.checkpoints_in(tmp_path / "run")] == ["update_1"]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_run_failed_in_its_first_update_is_started_again_by_the_same_command_once_fixed(
    tmp_path, monkeypatch, caplog
):
    """Its line says to run again once fixed: with no checkpoint there is nothing to resume, and the
    folder once refused the same command as a run's."""
    from miniverl.workers.teacher import TeacherWorker

    real = TeacherWorker.compute_teacher_log_prob

    def nan(self, batch, rows):
        batch = real(self, batch, rows)
        batch.teacher_logprobs = batch.teacher_logprobs * float("nan")
        return batch

    monkeypatch.setattr(TeacherWorker, "compute_teacher_log_prob", nan)
    with pytest.raises(MiniverlError, match="update 1 failed: non-finite loss .* no update completed, so there is"):
        run_toy(tmp_path / "run")
    assert not checkpoint.checkpoints_in(tmp_path / "run")
    monkeypatch.undo()  # the fix
    assert run_toy(tmp_path / "run")["status"] == "measured"
    assert (
        "stopped before its first checkpoint (no checkpoint; no report, or a failed one: non-finite loss nan"
        in caplog.text
    )


SIGNAL_ARGS = [  # 8 updates: the signal lands after the first checkpoint with 7 still to run (~2 s)
    "+recipe=opd_k1",
    "model=toy",
    "teacher=toy",
    "recipe.optimizer_updates=8",
    "recipe.interrupt_after_updates=null",
    "recipe.response_limit=8",
    "actor.optim.lr=1e-3",
    "trainer.progress_bar=false",
]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM])
def test_a_signal_mid_run_stops_cleanly_and_the_resume_is_exact(tmp_path, signum):
    reference = tmp_path / "reference"
    run(compose_config(SIGNAL_ARGS), reference)
    stopped = tmp_path / "stopped"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    child = subprocess.Popen(
        [sys.executable, "-m", "miniverl.main", *SIGNAL_ARGS, f"hydra.run.dir={stopped}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while not (stopped / "checkpoints" / "update_1").exists() and time.time() < deadline and child.poll() is None:
        time.sleep(0.01)
    child.send_signal(signum)
    _, stderr = child.communicate(timeout=300)
    assert child.returncode == 128 + signum, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"miniverl: error: stopped by {signal.Signals(signum).name} after update")
    assert f"trainer.resume_from={stopped}" in last and "Traceback" not in stderr
    report = json.loads((stopped / "report.json").read_text())
    assert report["status"] == "interrupted" and report["recipe"]["optimizer_updates"] == 8
    done = len((stopped / "metrics.jsonl").read_text().splitlines())
    assert 1 <= done < 8 and checkpoint.checkpoints_in(stopped)[-1].name == f"update_{done}"
    resumed = tmp_path / "resumed"  # in this process: the stop, not the resume, needs its own process
    run(compose_config([*SIGNAL_ARGS, f"trainer.resume_from={stopped}"]), resumed)
    assert first_difference(reference, resumed)[1] is None


def processes_writing_into(folder: Path) -> list[str]:
    """Live processes whose command line names `folder` (the resume check's children)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if str(folder) in text:
            found.append(text)
    return found


@pytest.mark.slow
def test_ctrl_c_during_the_resume_check_stops_in_one_line_and_the_same_command_finishes_the_check(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "miniverl.main", *RECIPE_RUN, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("HYDRA_FULL_ERROR", None)
    # Its own process group, as a terminal's foreground job: Ctrl-C is SIGINT to the whole group.
    child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)  # fmt: skip
    interrupted = run_dir / "resume_check" / "interrupted"
    deadline = time.time() + 300
    while not (interrupted / "plan.json").exists() and time.time() < deadline and child.poll() is None:
        time.sleep(0.05)  # the first child is training
    os.killpg(child.pid, signal.SIGINT)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 130, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("miniverl: error:")]
    assert len(lines) == 1 and "Traceback" not in out + err
    assert lines[0].startswith("miniverl: error: stopped by SIGINT during the resume check; the run itself is finished")
    assert lines[0].endswith(f"python -m miniverl.main {' '.join(RECIPE_RUN)} hydra.run.dir={run_dir}")
    assert processes_writing_into(interrupted) == []  # the check's child was killed with it
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "measured" and report["resume"]["status"] == "interrupted"
    kept = {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "peft_adapter/adapter_model.safetensors")}

    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "the finished run here: only its resume check (after update 1) runs" in again.stdout
    # Its progress, in the log (Hydra's console handler writes to stdout): which child, which update.
    assert "resume check: interrupted run, update 1/3" in again.stdout
    assert "resume check: resumed run, update 3/3" in again.stdout
    report = json.loads((run_dir / "report.json").read_text())
    assert report["resume"]["status"] == "exact_match" and report["resume"]["resumed_after_update"] == 1
    assert all((run_dir / name).read_bytes() == data for name, data in kept.items())  # nothing trained again
    assert "| `status` | exact_match |" in (run_dir / "report.md").read_text()


@pytest.mark.slow
def test_a_signal_in_the_last_update_keeps_the_finished_run_and_the_same_command_runs_only_its_check(
    tmp_path, monkeypatch
):
    """Stopped in its last update, a run has nothing left to resume: it is finished (its report
    says so), and the line it ends with gives the command that runs the resume check alone."""
    real_step = OPDTrainer.fit_step

    def step(self, update):
        metrics = real_step(self, update)
        if update.update == len(self.plan.updates):
            os.kill(os.getpid(), signal.SIGTERM)  # as from another terminal, during the last update
        return metrics

    monkeypatch.setattr(OPDTrainer, "fit_step", step)
    run_dir = tmp_path / "run"
    with pytest.raises(RunStopped) as info:
        run(compose_config(RECIPE_RUN), run_dir, args=RECIPE_RUN)
    line = str(info.value)
    assert line.startswith("stopped by SIGTERM in the last update (3 of 3): the run is finished and kept")
    assert line.endswith(f"python -m miniverl.main {' '.join(RECIPE_RUN)} hydra.run.dir={run_dir}")
    assert info.value.exit_code == 128 + signal.SIGTERM
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "measured" and report["resume"]["status"] == "interrupted"
    monkeypatch.undo()
    again = run(compose_config(RECIPE_RUN), run_dir, args=RECIPE_RUN)  # the command the line gives
    assert again["resume"]["status"] == "exact_match"


class SigtermUnhandled(Exception):
    pass


def sigterm_unhandled(signum, frame):
    raise SigtermUnhandled  # in place of Python's default, which would end the test session


@pytest.mark.slow
@pytest.mark.parametrize("when", ["while the models load", "SIGTERM while the models load", "a second one in update 2"])
def test_a_ctrl_c_with_no_update_to_finish_ends_in_one_line_saying_what_to_run(
    tmp_path, monkeypatch, capfd, request, when
):
    """Ctrl-C (or SIGTERM) during imports, loading or a held-out probe has no update in flight to
    finish, and a second one stops at once: either way one line, exit 130 (143), no traceback, and
    what it says to run runs."""
    run_dir = tmp_path / "run"
    status_expected = 130
    if when == "while the models load":

        def setup(self):
            raise KeyboardInterrupt

        monkeypatch.setattr(OPDTrainer, "setup", setup)
        expected = "stopped by SIGINT before any update was checkpointed; nothing to resume: run the same command again"
        again = []
    elif when == "SIGTERM while the models load":

        def setup(self):
            os.kill(os.getpid(), signal.SIGTERM)  # as from another terminal, or a scheduler's stop
            time.sleep(5)  # the handler runs here

        monkeypatch.setattr(OPDTrainer, "setup", setup)
        previous = signal.signal(signal.SIGTERM, sigterm_unhandled)
        request.addfinalizer(lambda: signal.signal(signal.SIGTERM, previous))
        expected = "stopped by SIGTERM before any update was checkpointed; nothing to resume: run the same command "
        expected += "again"
        status_expected, again = 128 + signal.SIGTERM, []
    else:
        real_step = OPDTrainer.fit_step

        def step(self, update):
            if update.update == 2:
                raise KeyboardInterrupt  # what the second Ctrl-C raises (the test below)
            return real_step(self, update)

        monkeypatch.setattr(OPDTrainer, "fit_step", step)
        expected = (
            f"stopped by SIGINT; the last complete checkpoint is {run_dir / 'checkpoints' / 'update_1'}; "
            f"resume with the same command and trainer.resume_from={run_dir / 'checkpoints' / 'update_1'}"
        )
        again = [f"trainer.resume_from={run_dir / 'checkpoints' / 'update_1'}"]
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    try:
        status = run_as_command("main", *BASE, f"hydra.run.dir={run_dir}")
    except KeyboardInterrupt:  # uncaught, it would stop the whole test session
        pytest.fail("the Ctrl-C left the command as a traceback")
    except SigtermUnhandled:
        pytest.fail("SIGTERM while the models load was left to Python's default: the process ends without a word")
    assert status == status_expected
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == [f"miniverl: error: {expected}"]
    assert expected in (run_dir / "main.log").read_text()
    monkeypatch.undo()
    assert run_as_command("main", *BASE, *again, f"hydra.run.dir={run_dir}") == 0  # as the line says


@pytest.mark.slow
def test_a_ctrl_c_before_the_resume_check_says_the_command_that_runs_only_the_check(tmp_path, monkeypatch, capfd):
    def release(self):
        raise KeyboardInterrupt  # in the moment between the run and the check's children

    monkeypatch.setattr(OPDTrainer, "release_models", release)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    run_dir = tmp_path / "run"
    try:
        status = run_as_command("main", *RECIPE_RUN, f"hydra.run.dir={run_dir}")
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C left the command as a traceback")
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("miniverl: error:")]
    assert (
        status == 130
        and "Traceback" not in err
        and errors
        == [
            "miniverl: error: stopped by SIGINT before the resume check; the run itself is finished and kept; to check "
            f"it: python -m miniverl.main {' '.join(RECIPE_RUN)} hydra.run.dir={run_dir}"
        ]
    )
    report = json.loads((run_dir / "report.json").read_text())  # the check that command runs alone
    assert report["status"] == "measured" and report["resume"]["status"] == "pending"


def test_ctrl_c_is_deferred_like_sigterm_and_a_second_one_stops_at_once():
    # The end-to-end test above sends SIGTERM; Ctrl-C takes the same handler.
    from miniverl.utils.signals import deferred_signals

    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN under a shell's `&`
    with deferred_signals() as request:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs between bytecodes of the main thread
        assert request.signum == signal.SIGINT and request.name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_no_pickle_and_no_remote_code_by_default():
    source = "\n".join(p.read_text() for p in (ROOT / "miniverl").rglob("*.py"))
    assert "torch.load(" not in source and "import pickle" not in source
    config = to_config(compose_config(["+recipe=opd_k1"]))
    assert config.model.trust_remote_code is False and config.teacher.trust_remote_code is False


def test_the_suite_cannot_open_a_network_connection():
    import socket

    with pytest.raises(RuntimeError, match="network connection"):
        socket.create_connection(("198.51.100.1", 443), timeout=1)


# ------------------------------------------------------------------ property-based
text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)  # what a parquet integer column holds
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text}),
    min_size=1,
    max_size=4,
)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(messages, min_size=1, max_size=6))
def test_any_verl_prompt_column_reads_back_exactly(tmp_path, rows):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": pa.array(rows), "data_source": ["x"] * len(rows)}), path)
    # The schema alone, not a composed config: 25 examples, and the data node is all the test reads.
    assert read_conversations(DataConfig(train_files=str(path))).messages == rows


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(st.one_of(st.none(), int64, text, st.lists(int64, max_size=3)), max_size=5))
def test_a_malformed_prompt_column_is_an_error_not_a_crash(tmp_path, values):
    path = tmp_path / "p.parquet"
    try:
        pq.write_table(pa.table({"prompt": pa.array(values)}), path)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return  # not expressible as one parquet column
    try:
        conversations = read_conversations(DataConfig(train_files=str(path)))
    except MiniverlError as error:
        assert "data.train_files" in str(error)
        return
    assert all(isinstance(m, list) and m for m in conversations.messages)  # plain strings become one user turn


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), text, st.floats(allow_nan=False, allow_infinity=False)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(value=json_values)
def test_canonical_serialization_is_a_fixed_point_and_ignores_key_order(value):
    data = canonical_json(value)
    assert canonical_json(json.loads(data)) == data
    if isinstance(value, dict):
        reordered = dict(reversed(list(value.items())))
        assert sha256_json(reordered) == sha256_json(value)
    assert data.decode("utf-8")  # valid UTF-8
    assert b"\n" not in data  # one line: newlines inside strings are escaped
