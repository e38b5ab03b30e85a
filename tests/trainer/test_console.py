"""The console: the start lines say what will run, and the progress bar where a run stands when it
stops early and when it resumes."""

from __future__ import annotations

import pytest

from miniverl.config import to_config
from miniverl.trainer.console import closing_lines, start_lines
from miniverl.trainer.runner import run

from conftest import SHORT, compose_config


def _bar_states(stderr: str) -> list[str]:
    return [s.split("|")[2].split()[0] for s in stderr.replace("\r", "\n").splitlines() if s.startswith("opd:")]


@pytest.mark.slow
def test_the_bar_stops_where_the_run_stopped_and_a_resume_starts_there(tmp_path, capsys):
    args = ["+recipe=opd_k1", *SHORT, "recipe.optimizer_updates=4", "trainer.progress_bar=true"]
    stopped = tmp_path / "stopped"
    assert run(compose_config([*args, "trainer.stop_after_updates=2"]), stopped)["status"] == "interrupted"
    states = _bar_states(capsys.readouterr().err)
    assert states[0] == "0/4" and states[-1] == "2/4"
    run(compose_config([*args, f"trainer.resume_from={stopped}"]), tmp_path / "resumed")
    states = _bar_states(capsys.readouterr().err)
    assert states[0] == "2/4" and states[-1] == "4/4"


@pytest.mark.parametrize(
    "extra,resume_line",
    [
        ([], "resume check after update 1"),
        (["trainer.stop_after_updates=2"], "no resume check (trainer.stop_after_updates is set; it runs after a whole"),
        (["trainer.resume_from=/some/run"], "no resume check (a resumed run; it runs after a whole fresh run)"),
    ],
)
def test_the_start_lines_say_whether_the_resume_check_will_run(tmp_path, extra, resume_line):
    config = to_config(
        compose_config(["+recipe=opd_k1", "model=toy", "teacher=toy", "recipe.optimizer_updates=3", *extra])
    )
    text = start_lines(config, tmp_path / "run")
    assert text.splitlines()[0] == f"miniverl: run folder {tmp_path / 'run'}"
    assert resume_line in text
    # The note on the moved check only where the check runs.
    assert ("note     resume check after update 1" in text) == (not resume_line.startswith("no resume check"))


def test_a_run_of_one_update_says_why_it_has_no_resume_check(tmp_path):
    """docs/resume.md says the console says so; it said `no resume check` alone (a docs audit)."""
    config = to_config(compose_config(["+recipe=opd_k1", "model=toy", "teacher=toy", "recipe.optimizer_updates=1"]))
    text = start_lines(config, tmp_path / "run")
    assert "no resume check" in text
    assert "note     resume check skipped: recipe.optimizer_updates=1 leaves no update to interrupt after" in text


def test_a_sweep_job_without_the_resume_check_has_no_note_on_where_it_would_run(tmp_path):
    config = to_config(compose_config(["+recipe=opd_k1", "model=toy", "teacher=toy", "recipe.optimizer_updates=2"]))
    text = start_lines(config, tmp_path / "run", sweep=True)
    assert "no resume check (a sweep job: recipe.resume_check_in_sweeps=true runs it)" in text
    assert "note" not in text


def test_the_start_lines_name_the_samples_the_reward_and_the_coefficient(tmp_path):
    lines = start_lines(to_config(compose_config(["+recipe=opd_k1_grpo_toy"])), tmp_path)
    assert "100 updates x 8 prompts x 4 samples" in lines
    assert "task rewards (the rule of each row's data_source), grpo advantages, + 0.1 x the distillation loss" in lines
    plain = start_lines(to_config(compose_config(["+recipe=opd_k1", "model=toy", "teacher=toy"])), tmp_path)
    assert "samples" not in plain and "reward" not in plain
    one = start_lines(to_config(compose_config(["+recipe=opd_k1", "recipe.optimizer_updates=1"])), tmp_path)
    assert "plan     1 update x 4 prompts," in one  # a new-user audit: "1 updates"


def test_a_reward_function_given_without_task_rewards_is_noted_as_not_read(tmp_path):
    lines = start_lines(
        to_config(
            compose_config(["+recipe=opd_k1", "model=toy", "teacher=toy", "reward.custom_reward_function.path=x.py"])
        ),
        tmp_path,
    )
    assert "note" in lines and "reward.custom_reward_function.path is not read" in lines


@pytest.mark.parametrize(
    ("overrides", "note"),
    [
        # A new-user audit: these ran with no word that they were not read.
        (
            ["+recipe=opd_k1_two_teachers_toy", "teacher.mode=ref", "teacher.dtype=bfloat16"],
            "teacher.dtype, teacher.mode are not read: teachers.arithmetic, teachers.echo score the rows",
        ),
        (
            ["+recipe=opd_k1", "model=toy", "teacher=toy", "algorithm.adv_estimator=rloo", "rollout.n=2"],
            "algorithm.adv_estimator is not read: estimator.use_task_rewards=false",
        ),
        # A user's audit: use_chunked_topk=true with k1 ran as without it, silently (as in verl)
        (
            ["+recipe=opd_k1", "model=toy", "teacher=toy", "estimator.use_chunked_topk=true", "estimator.topk=8"],
            "estimator.topk, estimator.use_chunked_topk are not read: estimator.loss_mode=k1 takes no teacher top-k",
        ),
        (
            ["+recipe=opd_k1", "estimator=reverse_kl_topk", "estimator.topk=8", "estimator.chunked_topk_chunk_size=64"],
            "estimator.chunked_topk_chunk_size is not read: estimator.loss_mode=reverse_kl_topk takes no teacher top-k",
        ),
        (["+recipe=opd_k1", "estimator=forward_kl_topk", "estimator.topk=8", "estimator.use_chunked_topk=true"], None),
        (["+recipe=opd_k1_two_teachers_toy", "teachers.echo.mode=ref", "rollout.n=2"], None),
        (["+recipe=opd_k1_grpo_toy", "algorithm.adv_estimator=rloo", "teacher.dtype=bfloat16"], None),
    ],
)
def test_a_setting_the_command_sets_and_the_run_does_not_read_is_noted(overrides, note, tmp_path):
    lines = start_lines(to_config(compose_config(overrides)), tmp_path, overrides=overrides)
    notes = [line.split("note", 1)[1].strip() for line in lines.splitlines() if line.strip().startswith("note ")]
    assert notes == ([note] if note else [])


def test_the_start_lines_name_each_teacher_with_the_key_it_scores(tmp_path):
    extra = ["teachers.echo.mode=ref", "default_teacher=echo"]
    config = to_config(compose_config(["+recipe=opd_k1_two_teachers_toy", *extra]))
    rows = dict(line.strip().split("  ", 1) for line in start_lines(config, tmp_path).splitlines()[1:])
    rows = {name: value.strip() for name, value in rows.items()}
    assert rows["teacher arithmetic"] == "toy, bytes tokenizer (NF4) for data_source=miniverl/toy_arithmetic"
    assert rows["teacher echo"] == "the student's base (teachers.echo.mode=ref) for data_source=miniverl/toy_echo"
    assert rows["routing"] == "a row of another data_source goes to echo"
    assert "teacher" not in rows  # the single teacher's block is not read


def test_the_closing_table_shows_the_held_out_curve_from_first_to_last_when_the_probe_ran():
    from miniverl.trainer.console import heldout_rows

    def curve(*values):
        return [{"update": 4 * i, "value": v} for i, v in enumerate(values)]

    exact = {"exact_reverse_kl": curve(7.554, 3.98, 0.638), "k1_mean": curve(7.6, 4.1, 0.63)}
    assert heldout_rows(exact) == [
        ("held-out", "7.554 at update 0 -> 0.638 at update 8 (exact reverse KL, nats per position)")
    ]
    # Above eval.exact_kl_max_vocab the exact KL is null: the k1 mean instead.
    assert heldout_rows({**exact, "exact_reverse_kl": None})[0][1].endswith("(k1 mean, nats per token)")
    assert heldout_rows(None) == [] and heldout_rows({"k1_mean": curve(7.6)}) == []  # no probe, or no update yet
    # A teacher of another tokenizer: the span k1 and the teacher's log-likelihood per character, both.
    cross = {"exact_reverse_kl": None, "k1_mean": curve(6.886, 6.941), "teacher_loglik_per_char": curve(-2.55, -2.635)}
    assert [text for _, text in heldout_rows(cross)] == [
        "6.886 at update 0 -> 6.941 at update 4 (k1 mean, nats per token)",
        "-2.55 at update 0 -> -2.635 at update 4 (the teacher's log-likelihood per character)",
    ]


CENTRED = {"advantage_baseline": "batch_mean", "kl_discount_factor": 0.0, "token_selection": {"by": "none"}}


def final_loss_line(recipe: dict, history: list[dict], progress: dict | None, tmp_path) -> str:
    """The closing table's `final loss` row of a run of `recipe` (report.json's recipe block)."""
    report = {
        "status": "measured",
        "recipe": {"optimizer_updates": len(history), "estimator": "k1", **recipe},
        "resume": {"status": "not_checked"},
        "measurements": {
            "steady_state_median_seconds": {},
            "steady_state_median_throughput": {},
            "peak_reserved_gib": None,
            "peak_rss_gib": 2.0,
            "batch_downshifts": {},
        },
        "distillation_progress": progress,
    }
    return next(line for line in closing_lines(report, history, tmp_path).splitlines() if "final loss" in line)


@pytest.mark.parametrize(
    ("recipe", "measured", "said"),
    [
        ({"advantage_baseline": "none"}, True, None),
        (CENTRED, True, "~0 by construction with estimator.advantage_baseline: the held-out rows below say what"),
        (CENTRED, False, "~0 by construction with estimator.advantage_baseline: set eval.every to measure"),
        # A new-user audit: a run stopped after update 1 with eval.every=2 was told to set eval.every.
        (CENTRED, "update 0 only", "the held-out probe has measured update 0 only so far (a resumed run goes on"),
        ({**CENTRED, "loss_agg_mode": "seq-mean-token-sum"}, True, "~0 by construction"),
        # A new-user audit: the discount's -0.055 was said to be ~0 by construction, in a run with no probe.
        ({**CENTRED, "kl_discount_factor": 0.9}, False, None),
        ({**CENTRED, "token_selection": {"by": "entropy", "keep": 0.5}}, True, None),
        ({**CENTRED, "loss_agg_mode": "seq-mean-token-mean"}, True, None),
        ({**CENTRED, "task_rewards": {"adv_estimator": "grpo"}}, True, None),
    ],
)
def test_the_final_loss_is_said_to_be_zero_by_construction_only_where_the_baseline_centres_what_the_loss_averages(
    recipe, measured, said, tmp_path
):
    """A new-user audit read `final loss 4.036e-08 nats` as the recipe's result: with the batch-mean
    baseline the mean advantage, and with it the PG loss at ratio 1, is zero whatever the student learned;
    not with a discount, a token selection, a per-sequence mean or a task reward beside it (a toy run of
    each: 4.5e-09, 1.6e-07 with seq-mean-token-sum; 0.075 with seq-mean-token-mean, 0.012 with entropy
    selection at keep 0.5)."""
    progress = {"exact_reverse_kl": [{"update": 0, "value": 2.0}, {"update": 1, "value": 1.5}]}
    if measured == "update 0 only":
        progress = {"exact_reverse_kl": progress["exact_reverse_kl"][:1], "k1_mean": [{"update": 0, "value": 2.2}]}
    final = final_loss_line(recipe, [{"actor/distillation/loss": 4.036e-8}], progress if measured else None, tmp_path)
    assert ("by construction" in final) == (said is not None)
    assert said is None or said in final


def test_a_probe_without_the_exact_kl_is_not_told_to_set_eval_every(tmp_path):
    """A teacher of another tokenizer: the probe measures the k1 mean and the log-likelihood per character, no
    exact KL; the final-loss line told a run with eval.every set to set it (a docs audit)."""
    spans = {"k1_mean": [{"update": 0, "value": 10.04}, {"update": 2, "value": 9.102}], "exact_reverse_kl": None}
    final = final_loss_line(CENTRED, [{"actor/distillation/loss": -0.005}], spans, tmp_path)
    assert final.endswith(
        "~0 by construction with estimator.advantage_baseline: the held-out rows below say what the student learned"
    )


def test_the_closing_table_gives_the_last_updates_loss(tmp_path):
    """(a tests audit: closing_lines was only given one update, so the first update's loss passed for the last)"""
    losses = [{"actor/distillation/loss": 1.0}, {"actor/distillation/loss": 2.0}]
    final = final_loss_line({"advantage_baseline": "none"}, losses, None, tmp_path)
    assert final.split() == ["final", "loss", "2", "nats", "(actor/distillation/loss", "at", "update", "2)"]


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["+recipe=opd_k1_privileged_toy"], ", with a privileged context (teacher.context)"),
        (
            ["+recipe=opd_k1_cross_tokenizer_cpu"],
            ", scoring the text in its own tokens if not the student's (teacher.tokenizer_alignment=text)",
        ),
        (  # a ref teacher's context went unsaid (a new-user audit)
            ["+recipe=opd_k1_privileged_toy", "teacher.mode=ref"],
            "the student's base (teacher.mode=ref), with a privileged context (teacher.context)",
        ),
        (  # the banner named the base and not the adapter that makes it a teacher
            ["+recipe=opd_k1", "model=toy", "teacher.mode=shared_base", "teacher.adapter=/adapters/teacher"],
            "the student's base + the adapter /adapters/teacher (teacher.mode=shared_base)",
        ),
        (["+recipe=opd_k1", "model=toy", "teacher=toy", "teacher.adapter=/adapters/t"], " + the adapter /adapters/t"),
    ],
)
def test_the_start_lines_say_what_a_teacher_reads_when_it_is_not_the_students_prompt_in_its_tokens(
    overrides, said, tmp_path
):
    """report.json recorded the privileged context and the text alignment; the console's teacher row did not."""
    lines = start_lines(to_config(compose_config(overrides)), tmp_path).splitlines()
    teacher = next(line for line in lines if line.strip().startswith("teacher"))
    assert teacher.endswith(said)
