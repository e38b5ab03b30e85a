"""Hydra multirun: every job gets its own folder and report; the sweep leaves a summary table and
plot; a value any job would refuse stops the sweep before it starts; a job failing as it runs is
listed as failed and loses nothing of the others."""

from __future__ import annotations

import csv
import json
import os
import shlex
import signal

import pytest
import torch
from hydra import compose, initialize_config_dir

from miniverl import sweep_summary
from miniverl.trainer.opd_trainer import OPDTrainer

from conftest import CONF, SHORT_SWEEP, multirun, run_as_command


def tree_digest(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_a_2x2_sweep_leaves_four_reports_and_a_summary(sweep_2x2):
    status, sweep_dir = sweep_2x2
    assert status == 0
    reports = [json.loads((sweep_dir / str(i) / "report.json").read_text()) for i in range(4)]
    assert {(r["recipe"]["estimator"], r["models"]["student"]["lora"]["r"]) for r in reports} == {
        ("k1", 8),
        ("k1", 16),
        ("k3", 8),
        ("k3", 16),
    }
    # Same prompts and seeds in every job: the plans differ only by the swept fields.
    assert (
        len({json.dumps(json.loads((sweep_dir / str(i) / "plan.json").read_text())["updates"]) for i in range(4)}) == 1
    )
    rows = read_csv(sweep_dir / "sweep_summary.csv")
    assert [row["job"] for row in rows] == ["0", "1", "2", "3"]
    assert {row["swept"] for row in rows} == {
        "estimator=k1 model.lora.r=8",
        "estimator=k1 model.lora.r=16",
        "estimator=k3 model.lora.r=8",
        "estimator=k3 model.lora.r=16",
    }
    for row, report in zip(rows, reports):
        assert row["status"] == "measured"
        losses = [
            json.loads(x)["actor/distillation/loss"]
            for x in (sweep_dir / row["job"] / "metrics.jsonl").read_text().splitlines()
        ]
        assert float(row["final_loss"]) == pytest.approx(losses[-1])
        assert float(row["rollout_tokens_per_second"]) == pytest.approx(
            report["measurements"]["steady_state_median_throughput"]["rollout_tokens_per_second"]
        )
        assert float(row["peak_rss_gib"]) > 0 and row["resume"] == "not_checked"
    md = (sweep_dir / "sweep_summary.md").read_text()
    assert md.count("| measured |") == 4
    png = (sweep_dir / "sweep_summary.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    import matplotlib.image

    assert matplotlib.image.imread(str(sweep_dir / "sweep_summary.png")).shape[2] in (3, 4)


@pytest.mark.slow
def test_a_failing_job_is_listed_and_the_others_finish(tmp_path, capfd):
    sweep_dir = tmp_path / "s"
    prompts = "data.train_files=data/toy_prompts.parquet,README.md,data/toy_prompts.parquet"  # there, not parquet
    assert multirun(sweep_dir, "+recipe=opd_k1", "model=toy", "teacher=toy", prompts) == 1
    assert "miniverl: error: sweep job(s) 1 failed" in capfd.readouterr().err
    rows = read_csv(sweep_dir / "sweep_summary.csv")
    assert [row["status"] for row in rows] == ["measured", "failed", "measured"]
    no_data = "pre-flight check failed (python -m miniverl.doctor shows all): data: data.train_files: "
    assert rows[1]["error"].startswith(no_data + "README.md is not a readable parquet file")
    assert (sweep_dir / "0" / "report.json").is_file() and (sweep_dir / "2" / "report.json").is_file()
    assert f"| failed | {no_data}" in (sweep_dir / "sweep_summary.md").read_text()


def test_a_value_any_job_would_refuse_stops_the_sweep_before_anything_is_written(tmp_path, capfd):
    """Every job is composed and validated before the first one starts: a refused value or a missing
    option in the last job is one line now, not a failure after the jobs before it have run."""
    sweep_dir = tmp_path / "s"
    swept = ["actor.optim.lr=1e-4,-1e-4", "model.lora.r=8,0"]
    assert multirun(sweep_dir, "+recipe=opd_k1", "model=toy", "teacher=toy", *swept) == 2
    out, err = capfd.readouterr()
    assert err.strip() == (
        "miniverl: error: 3 of the sweep's 4 jobs would fail, so none ran: "
        "job 1 (actor.optim.lr=0.0001 model.lora.r=0): model.lora.r=0 must be >= 1; "
        "job 2 (actor.optim.lr=-0.0001 model.lora.r=8): actor.optim.lr=-0.0001 must be > 0: AdamW's step size "
        "(0 would train nothing); "
        "job 3 (actor.optim.lr=-0.0001 model.lora.r=0): model.lora.r=0 must be >= 1; "
        "fix or drop those values and run the sweep again"
    )
    assert "Traceback" not in out and not sweep_dir.exists()
    assert multirun(sweep_dir, "+recipe=opd_k1", "model=toy", "teacher=toy", "estimator=k1,k4") == 2
    assert capfd.readouterr().err.startswith(
        "miniverl: error: 1 of the sweep's 2 jobs would fail, so none ran: job 1 (estimator=k4): In 'config': "
        "Could not find 'estimator/k4'; Available options in 'estimator': abs, "
    )
    assert not sweep_dir.exists()  # Hydra alone writes multirun.yaml before it composes a job
    prompts = "data.train_files=data/toy_prompts.parquet,/nowhere/prompts.parquet"  # a file that is not there
    assert multirun(sweep_dir, "+recipe=opd_k1", "model=toy", "teacher=toy", prompts) == 2
    assert capfd.readouterr().err.startswith(
        "miniverl: error: 1 of the sweep's 2 jobs would fail, so none ran: job 1 (data.train_files=/nowhere/prompts"
        ".parquet): data.train_files: /nowhere/prompts.parquet does not exist (paths are relative to "
    )
    assert not sweep_dir.exists()


@pytest.mark.slow
def test_user_mistakes_end_their_jobs_in_one_line_and_no_job_runs_the_resume_check_unless_asked(tmp_path, capfd):
    sweep_dir = tmp_path / "s"
    status = run_as_command(
        "main", "-m", "+recipe=opd_k1", "model=toy", "teacher=toy", "recipe.optimizer_updates=2",
        "recipe.interrupt_after_updates=8", "recipe.response_limit=8", f"hydra.sweep.dir={sweep_dir}",
        "data.train_files=data/toy_prompts.parquet,README.md,pyproject.toml",  # there, but not parquet
    )  # fmt: skip
    out, err = capfd.readouterr()
    assert status == 1 and "miniverl: error: sweep job(s) 1, 2 failed" in err and "Traceback" not in out + err
    assert "no resume check (a sweep job: recipe.resume_check_in_sweeps=true runs it)" in out
    rows = read_csv(sweep_dir / "sweep_summary.csv")
    assert [row["status"] for row in rows] == ["measured", "failed", "failed"]
    no_data = "pre-flight check failed (python -m miniverl.doctor shows all): data: data.train_files: "
    assert rows[1]["error"].startswith(no_data + "README.md is not a readable parquet file")
    assert rows[2]["error"].startswith(no_data + "pyproject.toml is not a readable parquet file")
    assert rows[0]["resume"] == "not_checked" and not (sweep_dir / "0" / "resume_check").exists()
    # 8 is past the 2 updates: a run would check after update 1 and say so; the job checks nothing, says nothing.
    assert json.loads((sweep_dir / "0" / "report.json").read_text())["resume"]["note"] is None
    for job in ("1", "2"):  # each failed job's folder: its record, its log ending in the line, nothing else
        assert sorted(p.name for p in (sweep_dir / job).iterdir()) == [".hydra", "error.txt", "main.log"]
        assert (sweep_dir / job / "main.log").read_text().strip().splitlines()[-1].endswith(rows[int(job)]["error"])


def test_the_summary_can_be_rebuilt_for_a_sweep_folder(sweep_2x2, capsys):
    _, sweep_dir = sweep_2x2
    before = (sweep_dir / "sweep_summary.csv").read_text()
    for name in ("sweep_summary.csv", "sweep_summary.md", "sweep_summary.png"):
        (sweep_dir / name).unlink()
    assert sweep_summary.main([str(sweep_dir)]) == 0
    assert (sweep_dir / "sweep_summary.csv").read_text() == before
    assert (sweep_dir / "sweep_summary.png").is_file()
    assert "estimator=k3 model.lora.r=16" in capsys.readouterr().out


def test_a_job_the_sweep_plans_and_no_folder_holds_is_listed_as_not_run(sweep_2x2, tmp_path):
    """A new-user audit removed a job's folder: the summary listed three jobs of four without a word."""
    import shutil

    _, sweep_dir = sweep_2x2
    copy = tmp_path / "s"
    shutil.copytree(sweep_dir, copy, ignore=shutil.ignore_patterns("2"))
    rows = sweep_summary.write_summary(copy)
    assert [(row["job"], row["status"]) for row in rows] == [
        ("0", "measured"),
        ("1", "measured"),
        ("2", "not run"),
        ("3", "measured"),
    ]
    assert rows[2]["swept"] == read_csv(sweep_dir / "sweep_summary.csv")[2]["swept"]
    assert rows[2]["error"].endswith("the same sweep command runs it")


def test_rebuilding_a_folder_without_jobs_is_one_line(tmp_path, capsys):
    assert sweep_summary.main([str(tmp_path)]) == 2
    assert "holds no Hydra job folders" in capsys.readouterr().err


@pytest.mark.parametrize("launcher,target", [("parallel", "JoblibLauncher"), ("slurm", "SlurmLauncher")])
def test_launcher_configs_compose(launcher, target):
    pytest.importorskip(
        {"parallel": "hydra_plugins.hydra_joblib_launcher", "slurm": "hydra_plugins.hydra_submitit_launcher"}[launcher]
    )
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith(target)


@pytest.mark.slow
def test_a_signal_stops_the_whole_sweep_and_its_line_gives_both_ways_to_go_on(tmp_path, capfd, monkeypatch):
    """Ctrl-C or SIGTERM in a sweep stops the sweep, not only the job in progress (which would leave
    the next job to start, and one signal per job to stop them all): the job stops after its update,
    the summary lists it, and its line gives the job's own command (that job alone, into a new
    folder) and the sweep's command in its folder (every job: finished ones kept, the stopped one
    resumed in place); another sweep in that folder is refused before anything is written."""
    real_step = OPDTrainer.fit_step

    def step(self, update):
        metrics = real_step(self, update)
        if update.update == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # as from another terminal, in job 0's first update
        return metrics

    monkeypatch.setattr(OPDTrainer, "fit_step", step)
    sweep_dir, job = tmp_path / "s", tmp_path / "s" / "0"
    swept = ["+recipe=opd_k1", "model=toy", "teacher=toy", "estimator=k1,k3"]
    assert multirun(sweep_dir, *swept) == 128 + signal.SIGTERM
    printed = capfd.readouterr()
    errors = [line for line in printed.err.splitlines() if line.startswith("miniverl: error:")]
    assert (printed.out + printed.err).count("stopped by SIGTERM") == 1  # once, not also as a log line before it
    command = shlex.join(["python", "-m", "miniverl.main", *swept[:3], "estimator=k1", *SHORT_SWEEP])
    # The suite's workers set OMP_NUM_THREADS, as joblib's do: the job's command carries it.
    threads = f"OMP_NUM_THREADS={torch.get_num_threads()} " if "OMP_NUM_THREADS" in os.environ else ""
    assert errors == [
        f"miniverl: error: stopped by SIGTERM after update 1, nothing left half-done; the last complete checkpoint "
        f"is {job}/checkpoints/update_1; resume with {threads}{command} and trainer.resume_from={job}; the sweep "
        f"stopped in job 0 (what ran: {sweep_dir}/sweep_summary.md); to go on with every job, run the sweep's "
        f"command again with hydra.sweep.dir={sweep_dir}"
    ]
    assert not (sweep_dir / "1").exists()
    rows = read_csv(sweep_dir / "sweep_summary.csv")
    assert [row["status"] for row in rows] == ["interrupted", "not run"]  # job 1 listed: the table has no gap
    assert rows[0]["error"].startswith("stopped by SIGTERM") and rows[1]["swept"] == "estimator=k3"
    assert rows[0]["swept"] == "estimator=k1"  # swept over the sweep's jobs, job 1 not run yet
    monkeypatch.undo()
    resumed = tmp_path / "resumed"  # the line's command
    assert (
        run_as_command("main", *shlex.split(command)[3:], f"trainer.resume_from={job}", f"hydra.run.dir={resumed}") == 0
    )
    report = json.loads((resumed / "report.json").read_text())
    assert report["status"] == "measured" and report["resume"]["resumed_after_update"] == 1

    assert multirun(sweep_dir, *swept) == 0  # the sweep's command again, in its folder
    rows = read_csv(sweep_dir / "sweep_summary.csv")
    assert [(row["status"], row["error"], row["resume"]) for row in rows] == [
        ("measured", "", "resumed"),
        ("measured", "", "not_checked"),
    ]
    in_place = json.loads((job / "report.json").read_text())
    assert in_place["resume"]["resumed_from"] == str(job / "checkpoints" / "update_1")
    assert in_place["artifacts"]["trajectory_sha256"] == report["artifacts"]["trajectory_sha256"]
    finished = tree_digest(sweep_dir)
    assert multirun(sweep_dir, *swept) == 0  # again: every job finished, kept as it is
    assert {p: d for p, d in tree_digest(sweep_dir).items() if p.suffix != ".log" and ".hydra" not in p.parts} == {
        p: d for p, d in finished.items() if p.suffix != ".log" and ".hydra" not in p.parts
    }
    assert multirun(sweep_dir, *swept, "trainer.overwrite=true") == 0  # asked: every job afresh in its folder
    rows = read_csv(sweep_dir / "sweep_summary.csv")
    assert [(row["status"], row["resume"]) for row in rows] == [("measured", "not_checked")] * 2
    capfd.readouterr()
    before = tree_digest(sweep_dir)
    assert multirun(sweep_dir, *swept[:3], "estimator=k1,k2") == 2
    refusal = capfd.readouterr().err.strip()
    assert refusal.startswith(f"miniverl: error: hydra.sweep.dir={sweep_dir} holds the runs of another sweep")
    # A sweep-audit: the line gave that sweep's trainer.overwrite=true to go on with, which restarts every job.
    assert "trainer.overwrite=true)" not in refusal.split("; choose")[0] and refusal.endswith(
        "run that sweep's command to go on with it (without the trainer.overwrite=true it had: that would start "
        "every job afresh)"
    )
    assert tree_digest(sweep_dir) == before


def test_a_sweep_into_the_folder_of_a_sweep_that_is_running_is_refused_before_it_writes(tmp_path, capfd):
    """A lose-work audit: the same sweep started twice into one folder ran each job in one process, the other
    refused there writing its error into the job folder the first was running: both listed every job as
    failed. The running sweep holds its folder's lock (here this process, as another would)."""
    from miniverl.utils.run_folder import flock_folder

    sweep_dir = tmp_path / "s"
    sweep_dir.mkdir()
    held = flock_folder(sweep_dir)
    try:
        assert multirun(sweep_dir, *SWEPT, "estimator=k1,k3") == 2
    finally:
        os.close(held)
    assert capfd.readouterr().err.strip() == (
        f"miniverl: error: hydra.sweep.dir={sweep_dir} is in use: another sweep is running there now; wait until it "
        "ends, then run the same command again (finished jobs are kept, stopped ones resume), or choose another "
        "hydra.sweep.dir"
    )
    assert list(sweep_dir.iterdir()) == []
    assert multirun(sweep_dir, *SWEPT, "estimator=k1,k3") == 0  # once it is free


def test_the_slurm_launcher_on_a_machine_without_slurm_is_one_line_before_anything_is_written(
    tmp_path, capfd, monkeypatch
):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch, no srun (submitit raised a RuntimeError traceback)
    sweep_dir = tmp_path / "s"
    assert multirun(sweep_dir, "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "+recipe=opd_k1") == 2
    assert capfd.readouterr().err.strip() == (
        "miniverl: error: hydra/launcher=slurm submits to SLURM, and this machine has no sbatch/srun: run the sweep "
        "on a SLURM login node, or here without hydra/launcher=slurm (hydra/launcher=parallel runs the jobs side by "
        "side)"
    )
    assert not sweep_dir.exists()


SWEPT = ["+recipe=opd_k1", "model=toy", "teacher=toy"]


@pytest.mark.parametrize(
    "args,said",
    [
        (
            ["trainer.seed=range(3,1)"],
            "the sweep has no jobs: trainer.seed=range(3,1) expands to none",
        ),
        (
            ["estimator=k1,k3", "hydra.sweep.subdir=x"],
            "hydra.sweep.subdir=x names the same folder for every job of the sweep: each job needs its own; leave it "
            "out (${{hydra.job.num}}) or make it name the job (${{hydra.job.override_dirname}})",
        ),
        (
            ["actor.optim.lr=interval(1e-5,1e-4)"],
            "BasicSweeper does not support sweep type : INTERVAL_SWEEP; list the values (a,b,c), or sweep with "
            "range(), choice() or glob()",
        ),
    ],
    ids=["no jobs", "one folder for all jobs", "a sweep type the sweeper lacks"],
)
def test_a_sweep_that_cannot_run_as_written_is_one_line_and_writes_nothing(tmp_path, capfd, args, said):
    """A sweep audit: these exited 0 having run nothing, let two jobs share one folder (the second refused,
    the summary naming the wrong job), or ended in Hydra's traceback."""
    sweep_dir = tmp_path / "s"
    assert multirun(sweep_dir, *SWEPT, *args) == 2
    out, err = capfd.readouterr()
    assert err.strip().splitlines() == [f"miniverl: error: {said.format(s=sweep_dir)}"] and "Traceback" not in out
    assert not sweep_dir.exists()


def test_multirun_with_cfg_is_one_line(capfd):
    assert run_as_command("main", "-m", *SWEPT, "estimator=k1,k3", "--cfg", "job") == 2
    assert capfd.readouterr().err.strip() == (
        "miniverl: error: Only one of --run, --multirun, --cfg, --info and --shell_completion can be specified: "
        "give one of them"
    )


def test_a_sweep_stopped_by_trainer_stop_after_updates_is_not_a_failure(tmp_path, capfd):
    sweep_dir = tmp_path / "my sweep"  # a space: the lines' commands stay one shell word each
    assert multirun(sweep_dir, *SWEPT, "estimator=k1,k3", "trainer.stop_after_updates=1") == 0
    out = capfd.readouterr().out
    assert (
        f"sweep: 0 of 2 jobs completed, 2 stopped at trainer.stop_after_updates (they go on with the sweep's command "
        f"and 'hydra.sweep.dir={sweep_dir}'); summary in {sweep_dir}/sweep_summary.md"
    ) in out
    assert f"and 'trainer.resume_from={sweep_dir}/0'" in out  # the job's own line, as shlex quotes it
    assert multirun(sweep_dir, *SWEPT, "estimator=k1,k3") == 0  # as the line says: both resume and finish
    assert [row["status"] for row in read_csv(sweep_dir / "sweep_summary.csv")] == ["measured", "measured"]


def test_ctrl_c_between_two_jobs_says_how_the_sweep_goes_on_in_its_folder(tmp_path, capfd, monkeypatch):
    """A sweep audit: a Ctrl-C after a job ended (or in joblib's wait) said "run the same command again",
    which started a new dated sweep and ran the finished jobs again."""
    real = sweep_summary.SweepSummaryCallback.on_job_end

    def then_ctrl_c(self, config, job_return, **kwargs):
        real(self, config, job_return, **kwargs)
        raise KeyboardInterrupt  # as Ctrl-C does between job 0's end and job 1's start

    monkeypatch.setattr(sweep_summary.SweepSummaryCallback, "on_job_end", then_ctrl_c)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    sweep_dir = tmp_path / "s"
    assert multirun(sweep_dir, *SWEPT, "estimator=k1,k3") == 130
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        f"miniverl: error: stopped by SIGINT; the sweep stopped (what ran: python -m miniverl.sweep_summary "
        f"{sweep_dir}); to go on with every job, run the sweep's command again with hydra.sweep.dir={sweep_dir}"
    )
    finished = tree_digest(sweep_dir / "0")
    monkeypatch.undo()
    assert multirun(sweep_dir, *SWEPT, "estimator=k1,k3") == 0  # as the line says
    assert [row["status"] for row in read_csv(sweep_dir / "sweep_summary.csv")] == ["measured", "measured"]
    kept = {p: d for p, d in tree_digest(sweep_dir / "0").items() if p.suffix != ".log" and ".hydra" not in p.parts}
    assert kept == {p: d for p, d in finished.items() if p.suffix != ".log" and ".hydra" not in p.parts}


def test_a_sweep_folder_whose_jobs_ran_refuses_another_sweep_and_a_shuffle_sweep_again(tmp_path, capfd):
    """A sweep audit: a sweep whose jobs had all failed let another sweep in, whose summary then listed the
    old failures; a shuffle() sweep run again numbered its jobs otherwise and failed its finished ones."""
    failed = tmp_path / "failed"
    assert multirun(failed, *SWEPT, "recipe.prompt_limit=4,5") == 1  # every job fails its pre-flight check
    capfd.readouterr()
    assert multirun(failed, *SWEPT, "estimator=k1") == 2
    assert f"hydra.sweep.dir={failed} holds the runs of another sweep" in capfd.readouterr().err
    shuffled = tmp_path / "shuffled"
    assert multirun(shuffled, *SWEPT, "recipe.optimizer_updates=1", "trainer.seed=shuffle(1,2)") == 0
    capfd.readouterr()
    before = tree_digest(shuffled)
    assert multirun(shuffled, *SWEPT, "recipe.optimizer_updates=1", "trainer.seed=shuffle(1,2)") == 2
    assert capfd.readouterr().err.strip() == (
        f"miniverl: error: hydra.sweep.dir={shuffled} holds a shuffle() sweep's runs, and shuffle() numbers the "
        "jobs anew each time, so its job folders cannot be matched to this run's jobs: choose another "
        "hydra.sweep.dir"
    )
    assert tree_digest(shuffled) == before


def test_a_sweep_holds_its_folders_lock_while_its_jobs_run_and_frees_it_after(tmp_path, monkeypatch):
    """What the refusal above rests on: each job runs with the sweep's folder locked by the command."""
    from miniverl.trainer import runner
    from miniverl.utils.run_folder import flock_folder

    seen = []

    def job(cfg, run_dir, args=(), sweep=False, record=None):
        try:
            os.close(flock_folder(run_dir.parent))
            seen.append("free")
        except BlockingIOError:
            seen.append("held")
        return {}

    monkeypatch.setattr(runner, "run", job)  # main imports it anew: each command runs the module afresh
    multirun(tmp_path / "s", *SWEPT, "estimator=k1,k3")
    assert seen == ["held", "held"]
    os.close(flock_folder(tmp_path / "s"))  # free once the command has ended
