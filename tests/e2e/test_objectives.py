"""The objectives beyond verl (docs/objectives.md) run the toy recipe, compose with several teachers
and task rewards, and stay byte-exact resumable: stopped after update 1 and resumed, a run ends
byte for byte as the whole one (the recipe's own check, in this process)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from argparse import Namespace

import pytest
import yaml

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
               "--every", "2", "--only", "k1;reverse top-k", "--seed", "2", "--out", str(out),
               "--runs", str(tmp_path / "runs"),
               "--set", "teacher.toy_pretrain_steps=3"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["objective"], r["seed"]) for r in rows] == [("k1", 2), ("reverse top-k", 2)]
    assert all(r["status"] == "measured" and sorted(map(int, r["exact_reverse_kl"])) == [0, 2] for r in rows)
    for i, name in enumerate(("k1", "reverse_kl_topk")):  # each run its objective and the seed asked for
        resolved = yaml.safe_load((tmp_path / "runs" / f"{i}-seed2" / "resolved_config.yaml").read_text())
        assert (resolved["estimator"]["loss_mode"], resolved["trainer"]["seed"]) == (name, 2)
    table = out.with_suffix(".md").read_text()
    assert "recipe `opd_k1_toy_distill`, seed 2, 2 updates" in table and "KL @ 2" in table
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_table_gives_each_objectives_median_over_the_seeds_and_each_seeds_last_kl(tmp_path):
    spec = importlib.util.spec_from_file_location("objectives_table", ROOT / "scripts" / "objectives_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)

    def row(objective, seed, last, status="measured"):
        return {"objective": objective, "seed": seed, "status": status, "exact_reverse_kl": {0: 5.0, 2: last},
                "seconds_per_update_median": seed, "peak_rss_gib": 1.0 + seed}  # fmt: skip

    rows = [row("k1", 1, 0.5), row("k3", 1, 0.25), row("k1", 2, 0.75), row("k3", 2, 9.0, status="failed")]
    table.write(rows, Namespace(recipe="opd_k1_toy_distill", updates=2), tmp_path / "t")
    text = (tmp_path / "t.md").read_text()
    assert "the median over seeds 1, 2, 2 updates" in text
    assert "| k1 | 5.000 | 0.625 | 0.500 / 0.750 | 1.50 | 3.00 |" in text  # median, each seed, s/update, RSS
    assert "| k3 | 5.000 | 0.250 | 0.250 / failed | 1.00 | 2.00 |" in text  # the measured run alone
    assert (tmp_path / "t.png").stat().st_size > 0
