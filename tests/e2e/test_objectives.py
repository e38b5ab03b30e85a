"""The objectives beyond verl (docs/objectives.md) run the toy recipe, compose with several teachers
and task rewards, and stay byte-exact resumable: stopped after update 1 and resumed, a run ends
byte for byte as the whole one (the recipe's own check, in this process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from miniverl.trainer.runner import run

from conftest import ROOT, compose_config, resumed_in_this_process

TOY = [
    "+recipe=opd_k1",
    "model=toy",
    "teacher=toy",
    "hardware=cpu",
    "recipe.optimizer_updates=2",
    "recipe.interrupt_after_updates=null",
    "recipe.response_limit=8",
    "trainer.progress_bar=false",
]
OBJECTIVES = {
    "k1 discounted with a baseline, entropy-selected": [
        "estimator=k1",
        "estimator.kl_discount_factor=0.9",
        "estimator.advantage_baseline=batch_mean",
        "estimator.token_selection.by=entropy",
        "estimator.token_selection.keep=0.5",
    ],
    "top-k with tail, overconfident-selected": [
        "estimator=forward_kl_topk_tail",
        "estimator.topk=8",
        "estimator.token_selection.by=overconfident",
        "estimator.token_selection.keep=0.5",
    ],
    "reverse top-k": ["estimator=reverse_kl_topk", "estimator.topk=8"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_each_objective_trains_the_toy_recipe_and_resumes_byte_exactly(tmp_path, name):
    report, difference = resumed_in_this_process([*TOY, *OBJECTIVES[name]], tmp_path, after=1)
    assert report["status"] == "measured" and difference is None, difference
    settings = dict(override.split("=", 1) for override in OBJECTIVES[name])
    recipe = report["recipe"]  # the report names the objective's settings beyond verl
    assert recipe["estimator"] == settings["estimator"]
    assert recipe["kl_discount_factor"] == float(settings.get("estimator.kl_discount_factor", 0.0))
    assert recipe["advantage_baseline"] == settings.get("estimator.advantage_baseline", "none")
    by, keep = settings.get("estimator.token_selection.by", "none"), settings.get("estimator.token_selection.keep", 1)
    assert recipe["token_selection"] == {"by": by, "keep": float(keep)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_each_objective_composes_with_two_teachers_task_rewards_a_teacher_context_and_teacher_modes(tmp_path, name):
    two = ["+recipe=opd_k1_two_teachers_toy", "recipe.optimizer_updates=1", "recipe.interrupt_after_updates=null",
           "recipe.response_limit=8", "eval.every=-1", "data.val_files=[]", "teachers.arithmetic.toy_pretrain_steps=2",
           "teachers.echo.toy_pretrain_steps=2", "trainer.progress_bar=false"]  # fmt: skip
    assert run(compose_config([*two, *OBJECTIVES[name]]), tmp_path / "two")["status"] == "measured"
    grpo = ["+recipe=opd_k1_grpo_toy", "recipe.optimizer_updates=1", "recipe.interrupt_after_updates=null",
            "recipe.response_limit=8", "eval.every=-1", "trainer.progress_bar=false"]  # fmt: skip
    assert run(compose_config([*grpo, *OBJECTIVES[name]]), tmp_path / "grpo")["status"] == "measured"
    context = ["+recipe=opd_k1_privileged_toy", "recipe.optimizer_updates=1", "recipe.interrupt_after_updates=null",
               "recipe.response_limit=8", "eval.every=-1", "teacher.toy_pretrain_steps=2",
               "trainer.progress_bar=false"]  # fmt: skip
    assert run(compose_config([*context, *OBJECTIVES[name]]), tmp_path / "context")["status"] == "measured"
    short = [*TOY, "recipe.optimizer_updates=1", "teacher.mode=ref"]
    assert run(compose_config([*short, *OBJECTIVES[name]]), tmp_path / "ref")["status"] == "measured"


@pytest.mark.slow
def test_the_table_script_runs_objectives_and_writes_its_table_plot_and_numbers(tmp_path):
    out = tmp_path / "table"
    command = [sys.executable, "scripts/objectives_table.py", "--recipe", "opd_k1_toy_distill", "--updates", "2",
               "--every", "1", "--only", "k1;reverse top-k", "--seeds", "2", "--out", str(out),
               "--runs", str(tmp_path / "runs"),
               "--set", "teacher.toy_pretrain_steps=3"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["objective"], r["seed"]) for r in rows] == [
        ("k1", 1),
        ("reverse top-k", 1),
        ("k1", 2),
        ("reverse top-k", 2),
    ]
    assert all(r["status"] == "measured" and sorted(map(int, r["exact_reverse_kl"])) == [0, 1, 2] for r in rows)
    table = out.with_suffix(".md").read_text()
    assert "the median over seeds 1, 2" in table and "KL @ 2" in table and out.with_suffix(".png").stat().st_size > 0
    k1 = [r["exact_reverse_kl"]["2"] for r in rows if r["objective"] == "k1"]
    assert k1[0] != k1[1]  # two seeds, two runs
    line = next(line for line in table.splitlines() if line.startswith("| k1 |")).split(" | ")
    assert line[3] == f"{(k1[0] + k1[1]) / 2:.3f}" and line[4] == f"{k1[0]:.3f} / {k1[1]:.3f}"  # median, by seed
