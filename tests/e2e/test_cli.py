"""The command a user types: `python -m miniverl.main +recipe=opd_k1 ...`, as a subprocess."""

from __future__ import annotations

import json

import pytest

from conftest import RECIPE_RUN as TOY
from conftest import ROOT, main, run_as_command


@pytest.fixture
def toy_run(recipe_run):
    return recipe_run


@pytest.mark.slow
def test_the_toy_recipe_runs_from_the_command_line(toy_run):
    result, run_dir = toy_run
    assert result.returncode == 0, result.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "measured" and report["recipe"]["optimizer_updates"] == 3
    assert report["models"]["student"]["model_id"] == "toy"
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.slow
def test_every_file_of_the_run_is_as_readable_as_the_umask_allows(toy_run):
    """safetensors writes its files 0600; the adapter, checkpoints, trajectories and toy weights get
    the mode every other file of the run gets (readable by others on a shared machine)."""
    import os

    _, run_dir = toy_run
    mask = os.umask(0)
    os.umask(mask)
    if 0o666 & ~mask == 0o600:
        pytest.skip(f"under umask {mask:04o} every file is 0600, safetensors' own mode: nothing to tell apart")
    tensors = sorted(run_dir.rglob("*.safetensors"))
    assert {"adapter_model.safetensors", "adapter.safetensors", "optimizer.safetensors"} <= {p.name for p in tensors}
    assert {p.relative_to(run_dir): oct(p.stat().st_mode & 0o777) for p in tensors} == {
        p.relative_to(run_dir): oct(0o666 & ~mask) for p in tensors
    }


@pytest.mark.slow
def test_main_log_holds_the_start_lines_every_update_and_the_closing_lines(toy_run):
    """With the progress bar on the console (the default), main.log still has one line per update."""
    _, run_dir = toy_run
    lines = [line.split(" - ", 1)[1] for line in (run_dir / "main.log").read_text().splitlines()]
    assert lines[0] == f"miniverl: run folder {run_dir}"
    assert [line.split()[1] for line in lines if line.startswith("update ")] == ["1/3", "2/3", "3/3"]
    assert any(line.startswith("  status") and "measured" in line for line in lines)
    assert lines[-1].startswith("  adapter ")


def test_the_toy_recipe_prints_no_warning_with_warnings_as_errors(toy_run):
    result, _ = toy_run
    assert result.returncode == 0, result.stderr[-2000:]
    # What is left on stderr: the progress bar and miniverl's own log lines, nothing else.
    lines = [line for line in result.stderr.replace("\r", "\n").splitlines() if line.strip()]
    others = [line for line in lines if not line.startswith("opd:") and "][miniverl" not in line]
    assert others == [], others[:5]
    assert not any("WARNING" in line or "Warning" in line for line in lines)


def test_the_console_says_what_will_run_at_once_and_closes_in_words(toy_run):
    result, run_dir = toy_run
    out = result.stdout.splitlines()
    assert out[0] == f"miniverl: run folder {run_dir}"
    assert out[1].split()[0] == "student" and "LoRA r=16" in out[1] and out[3].startswith("  plan     3 updates x 4")
    closing = out[out.index(next(line for line in out if line.strip().startswith("status"))) :]
    text = "\n".join(closing)
    assert "measured (3 of 3 updates)" in text and " nats (actor/distillation/loss at update 3)" in text
    assert "s/update" in text and "tokens/s" in text and "GiB resident" in text and "downshifts       none" in text
    assert "None" not in text and "{" not in text  # words and units, not Python reprs


def test_every_run_folder_has_its_report_as_a_page_and_its_curves(toy_run):
    _, run_dir = toy_run
    page = (run_dir / "report.md").read_text()
    assert page.startswith("# miniverl run: verl-opd-v0.8-single-gpu-pg-k1-v1") and "![curves](curves.png)" in page
    final = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["actor/distillation/loss"]
    assert f"**{final:.5g}**" in page and "| `resume.status` |" not in page and "| `status` | exact_match |" in page
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_recipe_checks_its_own_exact_resume(toy_run):
    result, run_dir = toy_run
    report = json.loads((run_dir / "report.json").read_text())
    resume = report["resume"]
    # Written after the models are released for the check: the last rollout's CPU decode paths survive them.
    assert set(report["hardware"]["rollout_decode"]) == {"reordered_layers", "fp16_lm_head"}
    # The toys' float32 weights: no half-precision product on any CPU (it said "native bf16 GEMM" on one with bf16).
    assert report["hardware"]["products"] == "float32 GEMM (no half-precision weights)"
    assert report["hardware"]["option"] == "auto"  # hardware.name, which its schema says the report records
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


def test_a_finished_run_folder_is_never_overwritten(toy_run, capfd):
    _, run_dir = toy_run
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and ".hydra" not in p.parts}
    assert run_as_command("main", *TOY, f"hydra.run.dir={run_dir}") == 2
    err = capfd.readouterr().err
    assert "already holds a finished run" in err and "Traceback" not in err
    assert "trainer.overwrite=true" in err
    assert all(p.read_bytes() == data for p, data in before.items())


@pytest.mark.slow
def test_a_refused_overwrite_leaves_the_runs_record_and_log_and_one_that_replaces_it_writes_its_own(tmp_path, capfd):
    """A lose-work audit: a trainer.overwrite=true command refused (a value out of range, the folder in use)
    rewrote the run's .hydra/ with its own overrides and added its error line to the run's main.log."""
    run_dir = tmp_path / "run"
    short = [*TOY, "recipe.interrupt_after_updates=null", f"hydra.run.dir={run_dir}"]
    assert run_as_command("main", *short) == 0
    kept = {p: p.read_bytes() for p in [*(run_dir / ".hydra").iterdir(), run_dir / "main.log"]}
    assert run_as_command("main", *short, "trainer.overwrite=true", "actor.optim.lr=-1e-4") == 2
    assert "actor.optim.lr=-0.0001 must be > 0" in capfd.readouterr().err
    assert {p: p.read_bytes() for p in kept} == kept
    assert run_as_command("main", *short, "trainer.overwrite=true", "actor.optim.lr=2e-5") == 0
    assert "actor.optim.lr=2e-5" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "lr: 2.0e-05" in (run_dir / ".hydra" / "config.yaml").read_text()
    assert json.loads((run_dir / "report.json").read_text())["status"] == "measured"
    # A run of this plan that ended before its first checkpoint (simulated: none kept, no report) is replaced by
    # the command run again, which records itself (a review: the earlier command's record stayed).
    import shutil

    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "report.json").unlink()
    assert run_as_command("main", *short, "actor.optim.lr=2e-5", "trainer.progress_bar=false") == 0
    assert "trainer.progress_bar=false" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "trainer.overwrite=true" not in (run_dir / ".hydra" / "overrides.yaml").read_text()


def test_a_folder_of_the_users_own_files_is_refused_without_writing_into_it(tmp_path, capfd):
    """A new-user audit: the refusal was right, and its error line was appended to the user's own main.log
    (and Hydra's .hydra/ written beside it)."""
    (tmp_path / "main.log").write_text("mine\n")
    (tmp_path / "report.md").write_text("mine\n")
    assert run_as_command("main", *TOY, f"hydra.run.dir={tmp_path}") == 2
    assert "holds report.md but no run of miniverl's" in capfd.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["main.log", "report.md"]
    assert (tmp_path / "main.log").read_text() == "mine\n"


def test_a_finished_run_of_other_settings_is_refused_as_finished_not_as_another_plan(toy_run, capfd):
    """Its plan's overrides would not resume it: the line says it is finished and where a new run goes."""
    _, run_dir = toy_run
    assert run_as_command("main", *TOY, "recipe.logical_batch=2", f"hydra.run.dir={run_dir}") == 2
    err = capfd.readouterr().err
    assert "already holds a finished run" in err and "another plan" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    "override,wording,fix",
    [
        ("recipe.logical_btch=2", "Could not override 'recipe.logical_btch'", "did you mean recipe.logical_batch?"),
        # verl's own names (a new-user audit: "spell the key as --cfg job prints it", though the field rules know)
        (
            "data.max_prompt_length=256",
            "Could not override",
            "data.max_prompt_length is verl's name: miniverl's is recipe.prompt_limit",
        ),
        (
            "actor_rollout_ref.actor.optim.lr=1e-5",
            "Could not override",
            "actor_rollout_ref.actor.optim.lr is verl's name: miniverl's is actor.optim.lr",
        ),
        # A config audit: a new key of a mapping takes a + (the line said to spell it as --cfg job prints it)
        (
            "data.apply_chat_template_kwargs.enable_thinking=true",
            "Could not override 'data.apply_chat_template_kwargs.enable_thinking'",
            "a new key of a mapping: add it with a +, +data.apply_chat_template_kwargs.enable_thinking=<value>",
        ),
        ("teachers.a.model_id=x", "Could not override", "a teacher is added with +teacher@teachers.a=<option>"),
        ("actor.lr=1e-4", "Could not override 'actor.lr'", "did you mean actor.optim.lr?"),  # a level off
        # and an override Hydra's grammar refuses is named, with the quoting that passes it
        (
            "teacher.context.user={{ hint }}",
            "teacher.context.user={{ hint }}: ",
            "quote the value for Hydra inside the shell's quotes: \"key='...'\"",
        ),
        (
            "model=tyo",
            "Could not find 'model/tyo'",
            "Available options in 'model': qwen3_0_6b, smollm2_135m_drop5, smollm2_135m_every2, "
            "smollm2_135m_every2_qwen2_tokenizer, "
            "toy, toy_qwen3",
        ),
    ],
)
def test_a_composition_mistake_is_hydras_wording_in_one_line_and_exit_2(override, wording, fix):
    result = main("+recipe=opd_k1", "model=toy", "teacher=toy", override)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("miniverl: error: ") and wording in result.stderr and fix in result.stderr


@pytest.mark.parametrize(
    "arguments,said",
    [
        # A config-audit's tracebacks: null or a number as a group's option; and a list, which Hydra merged silently
        (["model=null"], "model=null: the config group model takes one option's name, one of qwen3_0_6b"),
        (["estimator=3"], "estimator=3: the config group estimator takes one option's name"),
        (["estimator=[k1,k3]"], "the config group estimator takes one option's name, one of abs, forward_kl_topk"),
        (["estimator=[k1,k3]"], "; to run each, sweep with -m: estimator=k1,k3"),
        # argparse's usage block and "unrecognized arguments"
        (["-m", "estimator=k1,k3"], "estimator=k1,k3 follows one of Hydra's flags that follows an override: give"),
        (["estimator=true"], "an option named true is quoted for Hydra: \"estimator='true'\""),
        (["+teacher@teachers.x=[toy,toy_qwen3]"], "the config group teacher takes one option's name, one of"),
        # a ${...} that names nothing: Hydra's traceback from the overrides' list
        (["trainer.experiment_name=${foo}"], "trainer.experiment_name: Interpolation key 'foo' not found; a ${...}"),
    ],
)
def test_a_group_option_flag_or_reference_hydra_takes_otherwise_is_one_line_and_exit_2(tmp_path, arguments, said):
    result = main("+recipe=opd_k1", "model=toy", "teacher=toy", *arguments, f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert result.stderr.startswith("miniverl: error: ") and said in result.stderr


def test_a_sweep_with_a_reference_that_names_nothing_is_refused_before_any_job(tmp_path):
    """It ran (exit 0, no summary): the sweep's own checks read the overrides' list, which resolved the ${...}."""
    result = main("-m", *TOY, "estimator=k1,k3", "trainer.experiment_name=${foo}", f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 2 and "Traceback" not in result.stderr and not (tmp_path / "0").exists()
    assert "2 of the sweep's 2 jobs would fail, so none ran: job 0 (estimator=k1): trainer.experiment_name: " in (
        result.stderr
    )


def test_hydras_flags_after_every_override_are_read_as_hydra_reads_them():
    """The check of flags between overrides once refused a flag after the last one (docs/usage.md's --cfg job)."""
    result = main("+recipe=opd_k1", "model=toy", "teacher=toy", "trainer.seed=3", "--cfg", "job")
    assert result.returncode == 0 and "seed: 3" in result.stdout, result.stderr


def test_a_reference_to_another_key_in_an_override_is_the_keys_value(tmp_path):
    """trainer.experiment_name=${recipe.name} failed in a traceback: Hydra's list of the overrides resolved the
    reference against Hydra's own config."""
    cfg = tmp_path / "run" / ".hydra" / "config.yaml"
    result = main(*TOY, "recipe.optimizer_updates=1", "recipe.interrupt_after_updates=null",
                  "trainer.experiment_name=${recipe.name}", f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "experiment_name: ${recipe.name}" in cfg.read_text()  # Hydra's record keeps it as typed
    assert json.loads((tmp_path / "run" / "report.json").read_text())["status"] == "measured"


def test_a_recipe_of_ones_own_that_is_not_yaml_is_one_line_naming_the_file_and_line(tmp_path):
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / "mine.yaml").write_text("# @package _global_\nrecipe:\n  logical_batch: [1\n")
    result = main(f"--config-dir={tmp_path / 'conf'}", "+recipe=mine", "model=toy", "teacher=toy")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"miniverl: error: {tmp_path / 'conf' / 'recipe' / 'mine.yaml'}, line 4: not valid")


def test_a_swept_verl_key_is_answered_with_miniverls_name_as_a_single_one_is(tmp_path):
    """A new-user audit: with -m the sweep's own check of every job dropped the hint the single run gives."""
    result = main("-m", "+recipe=opd_k1", "model=toy", "teacher=toy", "data.max_prompt_length=64,128",
                  f"hydra.sweep.dir={tmp_path}")  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "job 0 (data.max_prompt_length=64): " in result.stderr
    assert "data.max_prompt_length is verl's name: miniverl's is recipe.prompt_limit" in result.stderr


def refused_run_folder(run_dir) -> str:
    """What a refused command leaves: Hydra's record and its log, whose last line is the error."""
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "main.log"]
    return (run_dir / "main.log").read_text().strip().splitlines()[-1]


def test_a_missing_parquet_is_one_line(tmp_path, capfd):
    status = run_as_command("main", *TOY, "data.train_files=/nowhere/prompts.parquet", f"hydra.run.dir={tmp_path}/r")
    out, err = capfd.readouterr()
    assert status == 2 and "WARNING" not in out + err  # no warning line saying the same first
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "data.train_files: /nowhere/prompts.parquet does not exist" in lines[0]
    assert refused_run_folder(tmp_path / "r").endswith(lines[0].removeprefix("miniverl: error: "))


@pytest.mark.slow
def test_a_negative_learning_rate_is_one_line_before_anything_is_written(tmp_path):
    result = main(*TOY, "actor.optim.lr=-1e-4", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    line = "actor.optim.lr=-0.0001 must be > 0: AdamW's step size (0 would train nothing)"
    assert result.stderr.strip() == f"miniverl: error: {line}"
    assert refused_run_folder(tmp_path / "run").endswith(line)
    # The same folder then takes the corrected command: nothing left behind to trip over.
    again = ["actor.optim.lr=1e-4", "recipe.interrupt_after_updates=null", f"hydra.run.dir={tmp_path / 'run'}"]
    fixed = main(*TOY, *again)
    assert fixed.returncode == 0, fixed.stderr[-2000:]


def test_missing_weights_are_one_line_without_traceback(tmp_path, capfd):
    assert run_as_command("main", "+recipe=opd_k1", f"hydra.run.dir={tmp_path / 'run'}") == 2
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("miniverl: error: model.model_id=Qwen/Qwen3-0.6B at revision c1899de")
    assert "model=toy teacher=toy" in lines[-1] and "Traceback" not in err


def test_a_combination_verl_refuses_is_one_line(tmp_path):
    result = main(*TOY, "estimator.use_policy_gradient=false", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert "miniverl: error: estimator: loss_mode=k1 with use_policy_gradient=false is refused" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_refused_resume_leaves_the_earlier_runs_log_as_it_was_and_shows_its_warnings(tmp_path, capfd):
    """A new-user audit's refused resume (another learning rate) appended its pre-flight WARN line to the
    earlier run's main.log, whose last line was then another command's."""
    run_dir = tmp_path / "run"
    unread = ["data.val_files=data/toy_prompts_heldout.parquet", "eval.every=-1"]  # a pre-flight WARN
    stopped = [*TOY, "recipe.interrupt_after_updates=null", *unread, f"hydra.run.dir={run_dir}"]
    assert run_as_command("main", *stopped, "trainer.stop_after_updates=1") == 0
    log_before = (run_dir / "main.log").read_bytes()
    assert b"pre-flight WARN data" in log_before  # the run's own warning, in its own log
    capfd.readouterr()
    assert run_as_command("main", *stopped, "trainer.stop_after_updates=1", "actor.optim.lr=1e-3") == 2
    printed = capfd.readouterr()
    assert "pre-flight WARN data" in printed.out + printed.err and "belongs to another plan" in printed.err
    assert (run_dir / "main.log").read_bytes() == log_before
