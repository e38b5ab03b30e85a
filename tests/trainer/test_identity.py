"""Run identity: the resolved-config digest and the compiled-plan digest are stable across
processes and change with every experiment field; run-control fields leave the plan alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miniverl.config import to_config
from miniverl.models.toy import build_toy_tokenizer
from miniverl.trainer.plan import compile_plan
from miniverl.utils.dataset import read_conversations, tokenize_prompts
from miniverl.utils.identity import canonical_json, resolved_config_digest

from conftest import ROOT, SHORT, compose_config

BASE = ["+recipe=opd_k1", *SHORT]


def digests(overrides: list[str]) -> tuple[str, str]:
    cfg = compose_config(overrides)
    config = to_config(cfg)
    prompts = tokenize_prompts(
        read_conversations(config.data), config.data, build_toy_tokenizer(), config.recipe.prompt_limit
    )
    return resolved_config_digest(cfg), compile_plan(config, prompts).digest


SCRIPT = f"""
import sys, json
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}, {str(Path(__file__).parent)!r}]
from test_identity import digests, BASE
print(json.dumps(digests(BASE)))
"""


@pytest.mark.slow
def test_digests_are_the_same_in_a_fresh_process():
    # Another process has another hash seed and another import order: the digests must not notice.
    fresh = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, check=True)
    assert tuple(json.loads(fresh.stdout.strip().splitlines()[-1])) == digests(BASE)


@pytest.mark.parametrize(
    "override",
    [
        "recipe.logical_batch=2",
        "recipe.optimizer_updates=4",
        "recipe.response_limit=12",
        "recipe.prompt_limit=100",
        "estimator.clip_ratio=0.3",
        "estimator.loss_agg_mode=seq-mean-token-mean",
        "model.lora.r=8",
        "model.toy.hidden_size=32",
        "teacher.toy_teacher_seed=5",
        "trainer.seed=2",
        "actor.optim.lr=1e-4",
        "rollout.temperature=0.7",
        "hardware.rollout_physical_batch=2",
        "data.shuffle=true",
        "recipe.interrupt_after_updates=1",
        "rollout.n=2",
        "estimator.use_task_rewards=true",
        "estimator.distillation_loss_coef=0.5",
        "algorithm.adv_estimator=rloo",
        "actor.clip_ratio_c=2.5",
    ],
)
@pytest.mark.slow
def test_any_experiment_field_changes_both_digests(override):
    base = digests(BASE)
    changed = digests([*BASE, override])
    assert changed[0] != base[0] and changed[1] != base[1]


@pytest.mark.parametrize(
    "override", ["trainer.experiment_name=other", "trainer.progress_bar=true", "trainer.logger=[console]"]
)
@pytest.mark.slow
def test_run_control_fields_change_the_config_digest_but_not_the_plan(override):
    base = digests(BASE)
    changed = digests([*BASE, override])
    assert changed[0] != base[0] and changed[1] == base[1]


def test_plan_lists_prompts_seeds_and_batches_per_update():
    config = to_config(compose_config([*BASE, "recipe.logical_batch=3", "hardware.rollout_physical_batch=2"]))
    prompts = tokenize_prompts(read_conversations(config.data), config.data, build_toy_tokenizer(), 128)
    plan = compile_plan(config, prompts)
    assert [u.prompt_rows for u in plan.updates] == [(0, 1, 2), (3, 4, 5), (6, 7, 8)]
    assert all(u.rollout_physical_batches == (2, 1) for u in plan.updates)
    seeds = [s for u in plan.updates for s in u.sample_seeds]
    assert len(set(seeds)) == len(seeds)  # one stream per sample


def test_with_shuffle_each_pass_over_the_prompts_is_its_own_permutation():
    """data.shuffle reorders the rows anew at each pass (epoch), from data.seed: a tests audit gave every
    pass epoch 0's order and no test noticed."""
    three_passes = ["recipe.logical_batch=16", "recipe.optimizer_updates=12"]  # 192 prompts of 64
    config = to_config(compose_config([*BASE, "data.shuffle=true", "data.repeat_prompts=true", *three_passes]))
    prompts = tokenize_prompts(read_conversations(config.data), config.data, build_toy_tokenizer(), 128)
    order = [row for u in compile_plan(config, prompts).updates for row in u.prompt_rows]
    rows = len(prompts)
    passes = [order[start : start + rows] for start in range(0, 3 * rows, rows)]
    assert all(sorted(each) == sorted(prompts.rows) for each in passes)
    assert passes[0] != list(prompts.rows)  # shuffled
    assert len({tuple(each) for each in passes}) == 3  # each pass its own order


def test_canonical_json_is_sorted_compact_utf8():
    assert canonical_json({"b": 1, "a": ["é", 2.5]}) == '{"a":["é",2.5],"b":1}'.encode()
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_with_rollout_n_each_prompt_has_n_adjacent_samples_with_streams_of_their_own():
    config = to_config(compose_config([*BASE, "recipe.logical_batch=3", "rollout.n=2", "hardware.update_chunk=4"]))
    prompts = tokenize_prompts(read_conversations(config.data), config.data, build_toy_tokenizer(), 128)
    plan = compile_plan(config, prompts)
    single = compile_plan(to_config(compose_config([*BASE, "recipe.logical_batch=3"])), prompts)
    first = plan.updates[0]
    assert first.prompt_rows == (0, 1, 2) and first.sample_rows == (0, 0, 1, 1, 2, 2)
    assert first.update_chunks == (4, 2)  # chunks and physical batches count samples
    seeds = [s for u in plan.updates for s in u.sample_seeds]
    assert len(seeds) == 2 * 3 * len(plan.updates) and len(set(seeds)) == len(seeds)
    # The first samples' streams are those of rollout.n=1: one rule derives every seed.
    assert first.sample_seeds[:3] == single.updates[0].sample_seeds
    assert plan.task_cursor(1) == 3  # the cursor counts prompts


def test_editing_the_users_reward_function_makes_another_plan(tmp_path):
    fn = tmp_path / "reward.py"
    fn.write_text("def compute_score(**kwargs):\n    return 0.0\n")
    task = [*BASE, "estimator.use_task_rewards=true", f"reward.custom_reward_function.path={fn}"]
    before = digests(task)
    fn.write_text("def compute_score(**kwargs):\n    return 1.0\n")  # same path, other code
    after = digests(task)
    assert before[0] == after[0] and before[1] != after[1]  # the config reads the same; the plan does not


def test_the_plan_holds_the_products_this_cpu_resolves_so_another_cpu_kind_is_another_plan(monkeypatch):
    from miniverl.models import cpu_gemm
    from miniverl.trainer.plan import experiment_settings
    from miniverl.workers.rollout import lean_decode

    cfg = to_config(compose_config(["+recipe=opd_k1", *SHORT]))
    assert cfg.hardware.cpu_float32_gemm is None and cfg.hardware.rollout_cpu_gemv is None  # "by the CPU"
    seen = {}
    for kind in (None, "amx"):
        monkeypatch.setattr(cpu_gemm, "cpu_bf16_instructions", lambda kind=kind: kind)
        monkeypatch.setattr(lean_decode, "cpu_bf16_instructions", lambda kind=kind: kind)
        hardware = experiment_settings(cfg)["hardware"]
        keys = ("cpu_float32_gemm", "rollout_cpu_gemv", "rollout_cpu_prepack", "rollout_cpu_fp16_lm_head")
        seen[kind] = tuple(hardware[key] for key in keys)
    assert seen == {None: (True, True, False, False), "amx": (False, False, True, True)}


def test_the_unwritable_byte_floor_enters_the_plan_only_where_set_so_older_runs_still_resume():
    """teacher.unwritable_byte_log_prob (null by default) is newer than most checkpoints: a plan
    without it set holds no such field, so their digests, and their resumes, are unchanged."""
    from miniverl.trainer.plan import experiment_settings

    unset = experiment_settings(to_config(compose_config(["+recipe=opd_k1", *SHORT])))
    assert "unwritable_byte_log_prob" not in unset["teacher"]
    floored = to_config(compose_config(["+recipe=opd_k1", *SHORT, "teacher.unwritable_byte_log_prob=-20"]))
    assert experiment_settings(floored)["teacher"]["unwritable_byte_log_prob"] == -20.0
