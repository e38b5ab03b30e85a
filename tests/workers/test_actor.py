"""Where the PPO ratio's old log-probs come from. By default the update's own forward (on-policy;
bitwise the separate pass: tests/workers/test_estimators.py), a pass of their own when dropout makes the
train forward random, and never a failed attempt's. With algorithm.rollout_correction.bypass_mode
(verl's key) the rollout's log-probs, and training is the default's up to rounding; without it,
verl's debug metrics compare the two."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from miniverl.config import to_config
from miniverl.models import loading as models
from miniverl.trainer.plan import compile_plan
from miniverl.trainer.resume_check import first_difference
from miniverl.trainer.runner import run
from miniverl.utils.dataset import read_conversations, tokenize_prompts

from conftest import compose_config

N = 4
ARGS = [
    "+recipe=opd_k1",
    "model=toy",
    "teacher=toy",
    "hardware=cpu",
    f"recipe.optimizer_updates={N}",
    "recipe.interrupt_after_updates=null",
    "recipe.response_limit=12",
    "actor.optim.lr=1e-3",
    "trainer.progress_bar=false",
]
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


@pytest.mark.slow
def test_a_bypass_run_resumes_exactly(runs, tmp_path):
    _, reference = runs["bypass"]
    stopped = tmp_path / "stopped"
    assert run(compose_config([*ARGS, BYPASS, "trainer.stop_after_updates=2"]), stopped)["status"] == "interrupted"
    report = run(compose_config([*ARGS, BYPASS]), stopped)  # resume_mode=auto continues the folder
    assert report["status"] == "measured" and report["resume"]["status"] == "resumed"
    assert first_difference(reference, stopped)[1] is None


# ---------------------------------------------------------------- the actor on its own


def tiny_actor(dropout: float):
    """A 2-layer Qwen3 with LoRA (non-zero B, `dropout` on its input), its ActorWorker (k1, PG) and
    a rolled-out batch whose teacher is the student itself."""
    from peft import LoraConfig, get_peft_model

    from miniverl.bench.loss_memory import small_qwen3
    from miniverl.config.actor import ActorConfig, RolloutConfig
    from miniverl.config.estimator import EstimatorConfig
    from miniverl.workers.actor import ActorWorker
    from miniverl.workers.rollout import RolloutWorker

    student = get_peft_model(
        small_qwen3(vocab=61, hidden=32, layers=2, seed=0),  # untied head, sdpa, EOS 7, pad 0
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=dropout, task_type="CAUSAL_LM"),
    )
    with torch.no_grad():
        for name, param in student.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    rollout = RolloutWorker(
        student.get_base_model(), RolloutConfig(), eos_ids=[7], pad_id=0, device=torch.device("cpu")
    )
    batch = rollout.generate_sequences(
        [[3, 9, 12], [11, 2], [30, 31, 32, 33], [50]],
        [0, 1, 2, 3],
        [1, 2, 3, 4],
        response_limit=10,
        physical_batches=[4],
    )
    batch.teacher_logprobs = batch.rollout_log_probs.clone()
    actor = ActorWorker(
        student,
        ActorConfig(),
        EstimatorConfig(loss_mode="k1", use_policy_gradient=True),
        temperature=1.0,
        logprob_chunk=64,
        loss_scale_factor=10,
    )
    return actor, batch


def test_with_dropout_the_old_log_probs_come_from_a_pass_of_their_own():
    actor, batch = tiny_actor(dropout=0.5)
    assert actor.random_train_forward
    expected = actor.compute_log_prob(batch, rows_per_forward=4)  # eval mode: the policy itself
    torch.manual_seed(1)
    actor.update_actor(batch, [4])
    assert torch.equal(batch.old_log_probs, expected)
    torch.testing.assert_close(batch.old_log_probs, batch.rollout_log_probs, atol=1e-5, rtol=0)


def test_a_failed_update_leaves_no_old_log_probs_behind():
    actor, batch = tiny_actor(dropout=0.0)
    assert not actor.random_train_forward

    def out_of_memory():
        raise torch.OutOfMemoryError("simulated, after the backward pass")

    actor.optimizer.step = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        actor.update_actor(batch, [4])
    assert batch.old_log_probs is None  # the retry (smaller chunks) takes them from its own forward
    del actor.optimizer.step
    actor.update_actor(batch, [2, 2])
    torch.testing.assert_close(batch.old_log_probs, batch.rollout_log_probs, atol=1e-5, rtol=0)


def test_each_teachers_loss_is_the_token_mean_over_its_samples_and_absent_without_any():
    from types import SimpleNamespace

    from miniverl.workers.actor_metrics import per_teacher_losses

    loss = torch.tensor([[1.0, 3.0, 9.0], [2.0, 4.0, 6.0], [5.0, 7.0, 0.0]])  # (B, R)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    batch = SimpleNamespace(teacher_index=torch.tensor([0, 1, 0]), response_mask=mask)
    metrics = per_teacher_losses(loss, batch, ("a", "b", "c"))
    assert metrics == {"actor/distillation/loss/a": (1 + 3 + 5) / 3, "actor/distillation/loss/b": (2 + 4 + 6) / 3}


@pytest.mark.parametrize(
    "actor,rollout,pearson",
    [
        ([0.0, 0.0, 0.0], [0.0, 0.0, 0.0], 1.0),  # a collapsed student: every token at probability 1
        ([0.0, 0.0, 0.0], [-0.1, -0.2, 0.0], None),  # one side constant: no correlation to speak of
        ([-0.5], [-0.4], None),  # one token: no spread
    ],
)
def test_the_rollout_vs_actor_metrics_stay_finite_where_a_correlation_is_undefined(actor, rollout, pearson):
    """A NaN in an update's metrics would make its checkpoint unwritable (strict JSON)."""
    from miniverl.protocol import Batch
    from miniverl.utils.identity import canonical_json
    from miniverl.workers.actor_metrics import rollout_actor_metrics

    n = len(actor)
    batch = Batch(
        **dict.fromkeys(("prompt_rows", "prompts", "responses", "input_ids", "attention_mask", "position_ids"), None),
        response_mask=torch.ones(1, n),
        rollout_log_probs=torch.tensor([rollout]),
        old_log_probs=torch.tensor([actor]),
    )
    m = rollout_actor_metrics(batch)
    canonical_json(m)  # raises on NaN or infinity
    assert m.get("training/rollout_actor_probs_pearson_corr") == pearson
    assert m["training/rollout_probs_diff_valid"] == 1 and m["training/rollout_probs_diff_std"] >= 0
    empty = rollout_actor_metrics(Batch(**{**batch.__dict__, "response_mask": torch.zeros(1, n)}))
    assert empty == {"training/rollout_probs_diff_valid": 0}
