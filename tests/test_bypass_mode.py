"""algorithm.rollout_correction.bypass_mode (verl's key): the rollout's log-probs are the old
log-probs, and training is what the on-policy default (old log-probs from the update's own
forward) gives, up to rounding. Without it, verl's debug metrics compare the two."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import compose_config
from miniverl.main import run
from miniverl.plan import compile_plan
from miniverl.data import read_conversations, tokenize_prompts
from miniverl import models
from miniverl.resume_check import first_difference
from miniverl.schema import to_config

N = 4
ARGS = ["+recipe=opd_k1", "model=toy", "teacher=toy", "hardware=cpu", f"recipe.optimizer_updates={N}",
        "recipe.interrupt_after_updates=null", "recipe.response_limit=12", "actor.optim.lr=1e-3",
        "trainer.progress_bar=false"]
BYPASS = "algorithm.rollout_correction.bypass_mode=true"


def trajectory(run_dir, update):
    return load_file(str(run_dir / "trajectories" / f"update_{update:06d}.safetensors"))


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, extra in (("on_policy", []), ("bypass", [BYPASS])):
        run_dir = tmp_path_factory.mktemp(name) / "run"
        out[name] = (run(compose_config([*ARGS, *extra]), run_dir), run_dir)
    return out


def test_bypass_uses_the_rollout_log_probs_as_old_log_probs(runs):
    _, run_dir = runs["bypass"]
    for update in range(1, N + 1):
        t = trajectory(run_dir, update)
        assert torch.equal(t["old_log_probs"], t["rollout_log_probs"])


def test_bypass_logs_no_rollout_vs_actor_comparison(runs):
    report, run_dir = runs["bypass"]
    for m in metrics(run_dir):
        assert "timing_s/update_actor" in m
        assert not any(key.startswith("training/rollout_") for key in m)
    assert report["measurements"]["steady_state_median_seconds"]["actor_update"] > 0


def test_on_policy_logs_how_far_the_rollout_is_from_the_actor(runs):
    _, run_dir = runs["on_policy"]
    for m in metrics(run_dir):
        assert "timing_s/old_log_prob" not in m  # no separate pass: the update's forward gives them
        assert m["actor/ppo_kl"] == 0.0  # ratio exactly 1
        assert m["training/rollout_probs_diff_valid"] == 1
        assert 0 <= m["training/rollout_probs_diff_mean"] <= m["training/rollout_probs_diff_max"] < 1e-5
        assert m["training/rollout_actor_probs_pearson_corr"] > 0.999999


def test_bypass_trains_what_the_on_policy_default_trains_up_to_rounding(runs):
    (_, on_policy), (_, bypass) = runs["on_policy"], runs["bypass"]
    first = trajectory(on_policy, 1), trajectory(bypass, 1)
    assert torch.equal(first[0]["responses"], first[1]["responses"])  # same weights sample the same tokens
    for update in range(1, N + 1):
        a, b = trajectory(on_policy, update), trajectory(bypass, update)
        torch.testing.assert_close(a["old_log_probs"], b["old_log_probs"], atol=1e-4, rtol=0)
    adapters = [load_file(str(d / "peft_adapter" / "adapter_model.safetensors")) for d in (on_policy, bypass)]
    for name, weight in adapters[0].items():
        torch.testing.assert_close(weight, adapters[1][name], atol=1e-5, rtol=1e-4)


def test_bypass_is_part_of_the_plan():
    digests = []
    for extra in ([], [BYPASS]):
        config = to_config(compose_config([*ARGS, *extra]))
        tokenizer = models.load_tokenizer("model", config.model, None)
        prompts = tokenize_prompts(read_conversations(config.data), config.data, tokenizer, config.recipe.prompt_limit)
        digests.append(compile_plan(config, prompts).digest)
    assert digests[0] != digests[1]  # a checkpoint of one is refused by the other


def test_a_bypass_run_resumes_exactly(runs, tmp_path):
    _, reference = runs["bypass"]
    stopped = tmp_path / "stopped"
    assert run(compose_config([*ARGS, BYPASS, "trainer.stop_after_updates=2"]), stopped)["status"] == "interrupted"
    report = run(compose_config([*ARGS, BYPASS]), stopped)  # resume_mode=auto continues the folder
    assert report["status"] == "completed" and report["resume"]["status"] == "resumed"
    assert first_difference(reference, stopped)[1] is None
