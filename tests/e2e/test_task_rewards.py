"""Task rewards beside distillation, end to end on the toy: every sample's score is its rule's on
its decoded response, at its last token; the task advantages are GRPO's over each prompt's
rollout.n samples; a run stopped and resumed, and a run whose batches were halved by
out-of-memory, sample and train the same; a row the reward cannot score is one line."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from miniverl.trainer.runner import run
from miniverl.utils.checkpoint import checkpoint_update, checkpoints_in
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import sha256_file
from miniverl.utils.reward_score import default_compute_score
from miniverl.workers.advantages import grpo_outcome_advantage

from conftest import SHORT, compose_config, trajectory

N_SAMPLES = 4  # the recipe's rollout.n
ARGS = [
    "+recipe=opd_k1_grpo_toy",
    "recipe.optimizer_updates=2",
    "recipe.logical_batch=2",
    "eval.every=-1",
    "data.val_files=[]",
    "teacher.toy_pretrain_steps=3",
    "trainer.progress_bar=false",
]


def task_run(run_dir, *extra):
    return run(compose_config([*ARGS, *extra]), run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("task") / "run"
    report = task_run(run_dir)
    assert report["status"] == "measured"
    return run_dir


@pytest.fixture(scope="module")
def parity_run(tmp_path_factory):
    """One update scored by a function of the user's: 1 for a response of odd length (a mix of 0 and 1)."""
    folder = tmp_path_factory.mktemp("parity")
    fn = folder / "parity_reward.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(len(solution_str) % 2), 'length': len(solution_str)}\n"
    )
    task_run(folder / "run", "recipe.optimizer_updates=1", f"reward.custom_reward_function.path={fn}")
    return folder / "run"


def test_each_score_is_its_rule_on_the_decoded_response_at_the_last_token(reference):
    tokenizer = AutoTokenizer.from_pretrained(reference / "toy_models" / "student")
    rows = pq.read_table("data/toy_digit_sums.parquet").to_pylist()
    truths = {row: record["reward_model"]["ground_truth"] for row, record in enumerate(rows)}
    scored = 0
    for update in (1, 2):
        t = trajectory(reference, update)
        lengths = t["response_mask"].sum(-1).long()
        for i, n in enumerate(lengths.tolist()):
            text = tokenizer.decode(t["responses"][i, :n].tolist(), skip_special_tokens=True)
            want = default_compute_score("miniverl/toy_arithmetic", text, truths[int(t["prompt_rows"][i])])
            assert t["token_level_scores"][i, n - 1] == want
            assert t["token_level_scores"][i].sum() == want  # nowhere else
            scored += 1
    assert scored == 2 * 2 * N_SAMPLES


@pytest.mark.slow
def test_task_advantages_are_grpo_over_each_prompts_samples(reference, parity_run):
    for run_dir in (reference, parity_run):
        t = trajectory(run_dir, 1)
        rows = t["prompt_rows"].view(-1, N_SAMPLES)
        assert (rows == rows[:, :1]).all()  # a prompt's samples are adjacent
        index = torch.arange(len(rows) * N_SAMPLES) // N_SAMPLES
        expected = grpo_outcome_advantage(t["token_level_scores"], t["response_mask"], index)
        assert torch.equal(t["task_advantages"], expected)
    scores = trajectory(parity_run, 1)["token_level_scores"].sum(-1)
    assert 0 < scores.sum() < len(scores)  # right and wrong samples: the advantages are not all zero
    assert trajectory(parity_run, 1)["task_advantages"].abs().sum() > 0


def test_the_metrics_carry_verls_task_reward_names(reference):
    history = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    for update, metrics in enumerate(history, start=1):
        scores = trajectory(reference, update)["token_level_scores"].sum(-1)
        assert metrics["critic/score/mean"] == pytest.approx(float(scores.mean()))
        assert metrics["critic/rewards/max"] == float(scores.max())
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "critic/advantages/mean", "timing_s/reward", "timing_s/adv"):
            assert key in metrics, key
        # verl's actor/loss: what was trained on, the task loss + distillation_loss_coef x the distillation loss.
        trained = metrics["actor/pg_loss"] + 0.1 * metrics["actor/distillation/loss"]
        assert metrics["actor/loss"] == pytest.approx(trained, rel=1e-5, abs=1e-7)
    recipe = json.loads((reference / "report.json").read_text())["recipe"]
    assert recipe["samples_per_prompt"] == N_SAMPLES
    assert recipe["task_rewards"] == {
        "adv_estimator": "grpo",
        "norm_adv_by_std_in_grpo": True,
        "distillation_loss_coef": 0.1,
        "reward_function": "rule of data_source",
    }


@pytest.mark.slow
def test_a_run_stopped_and_resumed_with_rollout_n_samples_equals_the_whole_run(reference, tmp_path):
    stopped = tmp_path / "stopped"
    assert task_run(stopped, "trainer.stop_after_updates=1")["status"] == "interrupted"
    assert task_run(stopped)["status"] == "measured"  # resume_mode=auto: goes on in its own folder
    for update in (1, 2):
        name = f"trajectories/update_{update:06d}.safetensors"
        assert sha256_file(stopped / name) == sha256_file(reference / name)
    name = "peft_adapter/adapter_model.safetensors"
    assert sha256_file(stopped / name) == sha256_file(reference / name)


@pytest.mark.slow
def test_a_downshift_with_rollout_n_samples_samples_the_same_tokens(reference, tmp_path):
    report = task_run(tmp_path / "oom", "hardware.simulate_oom_above_rows=2")
    assert report["measurements"]["batch_downshifts"]["rollout_oom"] > 0
    for update in (1, 2):
        a, b = trajectory(reference, update), trajectory(tmp_path / "oom", update)
        assert torch.equal(a["responses"], b["responses"])
        assert torch.equal(a["token_level_scores"], b["token_level_scores"])
        torch.testing.assert_close(a["task_advantages"], b["task_advantages"])


def test_a_row_without_a_rule_or_a_ground_truth_is_one_line_naming_the_row(tmp_path):
    rows = pq.read_table("data/toy_digit_sums.parquet").to_pylist()[:8]
    rows[5]["data_source"] = "my/benchmark"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "unknown.parquet")
    with pytest.raises(MiniverlError, match=r"row 5: no task-reward rule for data_source 'my/benchmark' \(rules: "):
        task_run(tmp_path / "a", f"data.train_files={tmp_path / 'unknown.parquet'}")
    rows[5]["data_source"] = "openai/gsm8k"
    rows[5]["reward_model"] = {"style": "rule", "ground_truth": None}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "no_truth.parquet")
    with pytest.raises(MiniverlError, match=r"row 5: no reward_model.ground_truth for the openai/gsm8k rule"):
        task_run(tmp_path / "b", f"data.train_files={tmp_path / 'no_truth.parquet'}")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before writing anything


def test_a_users_reward_function_scores_every_row(parity_run):
    t = trajectory(parity_run, 1)
    tokenizer = AutoTokenizer.from_pretrained(parity_run / "toy_models" / "student")
    for i, n in enumerate(t["response_mask"].sum(-1).long().tolist()):
        text = tokenizer.decode(t["responses"][i, :n].tolist(), skip_special_tokens=True)
        assert t["token_level_scores"][i].sum() == len(text) % 2


@pytest.mark.slow
def test_without_task_rewards_the_task_settings_change_no_byte(tmp_path):
    # Pure distillation reads none of them: the same trajectories and adapter, and no task columns.
    plain = ["+recipe=opd_k1", *SHORT, "recipe.optimizer_updates=2"]
    run(compose_config(plain), tmp_path / "a")
    unread = ["estimator.distillation_loss_coef=0.3", "algorithm.adv_estimator=rloo", "actor.clip_ratio=0.1"]
    run(compose_config([*plain, "estimator.use_task_rewards=false", *unread]), tmp_path / "b")
    for name in ("trajectories/update_000001.safetensors", "trajectories/update_000002.safetensors",
                 "peft_adapter/adapter_model.safetensors"):  # fmt: skip
        assert sha256_file(tmp_path / "a" / name) == sha256_file(tmp_path / "b" / name)
    assert not {"token_level_scores", "task_advantages"} & set(trajectory(tmp_path / "a", 1))


def test_a_reward_function_that_raises_mid_run_fails_the_update_with_a_report(tmp_path):
    fn = tmp_path / "late_reward.py"
    fn.write_text(
        "calls = []\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    calls.append(1)\n"
        "    if len(calls) > 8:  # the second update's first sample\n"
        "        raise RuntimeError('boom')\n"
        "    return 0.0\n"
    )
    run_dir = tmp_path / "run"
    with pytest.raises(MiniverlError) as error:
        task_run(run_dir, f"reward.custom_reward_function.path={fn}")
    message = str(error.value)
    assert message.startswith("update 2 failed: the task reward (compute_score of ")
    assert "RuntimeError: boom (late_reward.py line 5) on row" in message
    # A new-user audit fixed the function and reran "the same command", as the line said: refused, since the
    # file is part of the plan. The line now says a fixed function is a new run; the checkpoint resumes unchanged.
    assert "fix it and start a new run (the function's file is part of the plan" in message
    assert f"(resume with trainer.resume_from={run_dir} with the function's file unchanged)" in message
    assert json.loads((run_dir / "report.json").read_text())["status"] == "failed"
    cause = error.value.__cause__.__cause__  # MiniverlError <- RewardFailed <- the user's own exception
    assert isinstance(cause, RuntimeError) and cause.__traceback__.tb_next is not None  # HYDRA_FULL_ERROR shows it


def test_a_reward_function_that_raises_in_the_held_out_probe_fails_the_run_in_one_line(tmp_path):
    fn = tmp_path / "late_reward.py"
    fn.write_text(
        "calls = []\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    calls.append(1)\n"
        "    if len(calls) > 16 + 8:  # the probe's 16 held-out rows before training, update 1's 8 samples\n"
        "        raise RuntimeError('boom')\n"
        "    return 0.0\n"
    )
    run_dir = tmp_path / "run"
    heldout = ["data.val_files=data/toy_digit_sums_heldout.parquet", "eval.every=1"]
    with pytest.raises(MiniverlError) as error:
        task_run(run_dir, *heldout, f"reward.custom_reward_function.path={fn}")
    message = str(error.value)
    assert message.startswith("update 1 failed: held-out probe after update 1: the task reward (compute_score of ")
    assert json.loads((run_dir / "report.json").read_text())["status"] == "failed"
    # Update 1 is complete: it is kept under its own number, and its resume measures the probe first.
    assert [checkpoint_update(c) for c in checkpoints_in(run_dir)] == [1]
    # The function is part of the plan: fixed, it is another experiment, which the refusal says in one
    # line (before: it proposed an override of the file's sha256, which is no config key).
    fn.write_text(fn.read_text().replace("raise RuntimeError('boom')", "return 1.0"))
    with pytest.raises(MiniverlError) as refused:
        task_run(run_dir, *heldout, f"reward.custom_reward_function.path={fn}")
    assert "\n" not in str(refused.value) and "sha256=" not in str(refused.value)
    assert "the file of reward.custom_reward_function.path changed since that run" in str(refused.value)


def test_task_rewards_compose_with_the_full_vocabulary_kl(tmp_path):
    report = task_run(tmp_path / "run", "recipe.optimizer_updates=1", "estimator=reverse_kl_full")
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert report["status"] == "measured" and report["recipe"]["estimator"] == "reverse_kl_full"
    assert metrics["actor/distillation/loss"] > 0 and "actor/pg_loss" in metrics  # the KL beside the task PPO loss
