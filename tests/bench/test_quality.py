"""`bench --quality`: miniverl and TRL trained on the same folders from the same LoRA
initialisation, every student measured by miniverl's probe; the ratios are the same-objective
pairs' medians over the seeds."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from conftest import ROOT, toy_model_folders


def run_quality(tmp_path, *extra: str, timeout: int = 900) -> tuple[subprocess.CompletedProcess, Path]:
    """`bench --quality` on the toy folders, one seed, two updates; returns the process and --out."""
    folders = toy_model_folders(tmp_path)
    out = tmp_path / "quality"
    command = [sys.executable, "-m", "miniverl.bench", "--quality", "--student", str(folders["student"])]
    command += ["--teacher", str(folders["teacher"]), "--seeds", "1", "--updates", "2", "--out", str(out), *extra]
    return subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=timeout), out


@pytest.mark.slow
def test_quality_trains_every_side_from_one_start_and_probes_them_alike(tmp_path):
    pytest.importorskip("trl")
    done, out = run_quality(tmp_path, "--override", "data.shuffle=true")  # an ablation of miniverl's sides
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "quality.json").read_text())
    sides = result["sides"]
    assert set(sides) == {"miniverl_k1", "miniverl_full", "trl_iwopd", "trl_distill"}
    start = {name: side["heldout_kl"]["0"] for name, side in sides.items()}
    # One LoRA initialisation (B = 0) and one probe: every side starts from the very same number.
    assert len(set(start.values())) == 1, start
    for name, side in sides.items():
        assert side["heldout_kl"]["2"] != start[name], name  # it trained
        assert len(side["seeds"]["1"]["update_seconds"]) == 2 and side["seconds_per_update"] > 0
    # miniverl's own sides: the values of the run's own report.
    report = json.loads((out / "runs" / "miniverl_k1_seed1" / "report.json").read_text())
    own = {str(p["update"]): p["value"] for p in report["distillation_progress"]["exact_reverse_kl"]}
    assert sides["miniverl_k1"]["heldout_kl"] == own
    assert result["miniverl_overrides"] == ["data.shuffle=true"]
    for name in ("miniverl_k1", "miniverl_full"):  # the override reached both miniverl sides
        resolved = (out / "runs" / f"{name}_seed1" / "resolved_config.yaml").read_text()
        assert "shuffle: true" in resolved, name
    ratios = result["ratios"]
    assert ratios["heldout_kl_vs_trl_iwopd"] == pytest.approx(
        sides["miniverl_k1"]["heldout_kl"]["2"] / sides["trl_iwopd"]["heldout_kl"]["2"], rel=1e-3
    )
    assert ratios["seconds_per_update_vs_trl"] == max(
        ratios["seconds_per_update_vs_trl_iwopd"], ratios["seconds_per_update_vs_trl_distill"]
    )
    # What each side's LoRA trained in: TRL's DistillationTrainer casts a quantized model's LoRA
    # weights to bf16 (TRL 1.16, QLoRA's recommendation); IWOPDTrainer and miniverl keep float32.
    dtypes = {name: side["adapter_dtype"] for name, side in sides.items()}
    assert dtypes == {
        "miniverl_k1": "float32",
        "miniverl_full": "float32",
        "trl_iwopd": "float32",
        "trl_distill": "bfloat16",
    }
    per_seed = result["heldout_kl_ratios_per_seed"]  # one seed: its own ratio is the median's
    assert per_seed["heldout_kl_vs_trl_distill"]["1"] == pytest.approx(ratios["heldout_kl_vs_trl_distill"], abs=1e-4)
    assert (out / "quality.png").stat().st_size > 0 and "heldout_kl_vs_trl_distill" in (out / "quality.md").read_text()


def test_the_ratios_are_medians_over_seeds_of_the_same_objective_pairs_and_each_seeds_own_is_kept():
    from miniverl.bench.quality import markdown, summarise

    def side(kl_end, seconds, dtype="float32"):
        return {"heldout_kl": {0: 5.0, 2: kl_end}, "update_seconds": seconds, "adapter_dtype": dtype}

    sides = {
        "miniverl_k1": {1: side(1.0, [2.0, 2.0]), 2: side(3.0, [2.0, 4.0])},
        "miniverl_full": {1: side(0.5, [3.0, 3.0]), 2: side(0.5, [3.0, 3.0])},
        "trl_iwopd": {1: side(2.0, [4.0, 4.0]), 2: side(2.0, [4.0, 4.0])},
        "trl_distill": {1: side(1.0, [2.0, 2.0], "bfloat16"), 2: side(1.0, [2.0, 2.0], "bfloat16")},
    }
    args = Namespace(
        updates=2, argv=["--quality"], student="s", teacher="t", train="a", heldout="b", override=[], objective="both"
    )
    result = summarise(args, [1, 2], sides, None)
    ratios = result["ratios"]
    assert ratios["heldout_kl_vs_trl_iwopd"] == 1.0  # median(1, 3) / median(2, 2)
    # ...while seed by seed miniverl's k1 is ahead on one and behind on the other.
    assert result["heldout_kl_ratios_per_seed"] == {
        "heldout_kl_vs_trl_iwopd": {"1": 0.5, "2": 1.5},
        "heldout_kl_vs_trl_distill": {"1": 0.5, "2": 0.5},
    }
    table = markdown(result)
    assert "| heldout_kl_vs_trl_iwopd | 0.500 | 1.500 | 1 of 2 seeds | 1.00 |" in table
    assert "| heldout_kl_vs_trl_distill | 0.500 | 0.500 | 2 of 2 seeds | 0.50 |" in table  # two seeds' best
    assert ratios["heldout_kl_vs_trl_distill"] == 0.5
    assert ratios["seconds_per_update_vs_trl_iwopd"] == 0.625  # median(2, 3) / 4
    assert ratios["seconds_per_update_vs_trl_distill"] == 1.5
    assert ratios["seconds_per_update_vs_trl"] == 1.5  # the slower pair
    assert "| heldout_kl_vs_trl_iwopd | 1.000 | <= 1.0 | yes |" in table  # each target, met or not
    assert "| seconds_per_update_vs_trl | 1.500 | <= 1.0 | **no** |" in table
    assert result["sides"]["trl_distill"]["adapter_dtype"] == "bfloat16"  # each side's own, in the table
    assert "| trl_distill | " + result["sides"]["trl_distill"]["computes"] + " | bfloat16 |" in table


def test_the_plot_shows_each_probe_per_update_and_at_the_training_seconds_its_run_had_spent(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from miniverl.bench.quality import plot, summarise

    def side(seconds):
        return {1: {"heldout_kl": {0: 5.0, 2: 1.0}, "update_seconds": seconds, "adapter_dtype": "float32"}}

    sides = {"miniverl_k1": side([1.5, 2.5]), "trl_iwopd": side([3.0, 5.0])}
    args = Namespace(
        updates=2, argv=["--quality"], student="s", teacher="t", train="a", heldout="b", override=[], objective="k1"
    )
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    plot(summarise(args, [1], sides, None), tmp_path / "quality.png")
    by_update, by_second = figures[0].axes
    assert [list(line.get_xdata()) for line in by_update.get_lines()] == [[0, 2], [0, 2]]
    seconds = {line.get_label(): list(line.get_xdata()) for line in by_second.get_lines()}
    assert seconds == {"miniverl_k1": [0, 4.0], "trl_iwopd": [0, 8.0]}  # the same KL, in half the time


def test_the_sign_test_is_the_two_sided_binomial_of_the_seeds_split():
    from miniverl.bench.quality import sign_test_p

    # 2 * P(X <= min(k, n - k)) for X ~ Binomial(n, 1/2), at most 1; ties left out by the caller.
    assert sign_test_p(2, 0) == 0.5 and sign_test_p(1, 1) == 1.0 and sign_test_p(0, 0) == 1.0
    assert sign_test_p(6, 2) == 2 * (1 + 8 + 28) / 256  # 0.289: six of eight is not yet a gap
    assert sign_test_p(1, 7) == sign_test_p(7, 1) == 2 * (1 + 8) / 256  # 0.070
    assert sign_test_p(8, 0) == 2 / 256


def test_without_trl_the_peer_ratios_are_null_with_the_reason():
    from miniverl.bench.quality import summarise

    runs = {1: {"heldout_kl": {0: 5.0, 2: 1.0}, "update_seconds": [1.0], "adapter_dtype": "float32"}}
    args = Namespace(
        updates=2, argv=[], student="s", teacher="t", train="a", heldout="b", override=[], objective="both"
    )
    result = summarise(args, [1], {"miniverl_k1": runs, "miniverl_full": runs}, "TRL is not installed")
    assert all(v is None for v in result["ratios"].values())
    assert set(result["null_reasons"].values()) == {"TRL is not installed"}
    assert result["heldout_kl_ratios_per_seed"] == {}


@pytest.mark.slow
def test_one_objective_trains_its_pair_and_nothing_else(tmp_path):
    pytest.importorskip("trl")
    done, out = run_quality(tmp_path, "--objective", "full")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "quality.json").read_text())
    assert set(result["sides"]) == {"miniverl_full", "trl_distill"}
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["miniverl_full_seed1", "trl_distill_seed1"]
    assert result["ratios"]["heldout_kl_vs_trl_distill"] > 0 and result["ratios"]["heldout_kl_vs_trl_iwopd"] is None


def test_one_objective_gives_its_pairs_ratios_and_says_why_the_others_are_null():
    from miniverl.bench.quality import markdown, summarise

    def runs(kl_end, seconds):
        return {1: {"heldout_kl": {0: 5.0, 2: kl_end}, "update_seconds": [seconds], "adapter_dtype": "float32"}}

    args = Namespace(
        updates=2, argv=[], student="s", teacher="t", train="a", heldout="b", override=[], objective="k1"
    )  # fmt: skip
    result = summarise(args, [1], {"miniverl_k1": runs(1.0, 2.0), "trl_iwopd": runs(2.0, 4.0)}, None)
    ratios = result["ratios"]
    assert (ratios["heldout_kl_vs_trl_iwopd"], ratios["seconds_per_update_vs_trl_iwopd"]) == (0.5, 0.5)
    assert ratios["seconds_per_update_vs_trl"] == 0.5  # the slower of the pairs that ran: the one
    assert ratios["heldout_kl_vs_trl_distill"] is None and ratios["seconds_per_update_vs_trl_distill"] is None
    assert result["null_reasons"]["heldout_kl_vs_trl_distill"] == "not run: --objective k1 trains the other pair"
    assert result["objective"] == "k1" and set(result["sides"]) == {"miniverl_k1", "trl_iwopd"}
    assert set(result["heldout_kl_ratios_per_seed"]) == {"heldout_kl_vs_trl_iwopd"}
    assert (
        result["null_reasons"]["seconds_per_update_vs_trl_distill"] == "not run: --objective k1 trains the other pair"
    )
    assert markdown(result).startswith(
        "# Learning per update: miniverl and TRL (2 updates, seeds [1], the k1 pair only)"
    )
    # Without TRL the pair that ran says why it has no ratios, the other that it was not run.
    alone = summarise(args, [1], {"miniverl_k1": runs(1.0, 2.0)}, "TRL is not installed")
    assert alone["null_reasons"]["heldout_kl_vs_trl_iwopd"] == "TRL is not installed"
    assert alone["null_reasons"]["seconds_per_update_vs_trl"] == "TRL is not installed"
    assert alone["null_reasons"]["heldout_kl_vs_trl_distill"].startswith("not run: --objective k1")


def test_the_k1_side_keeps_the_recipes_baseline_and_the_full_vocabulary_side_has_none():
    from miniverl.bench.quality import SIDES, compose, compose_miniverl_side
    from miniverl.config import to_config
    from miniverl.utils.errors import MiniverlError

    args = Namespace(
        student="s", teacher="t", train="data/toy_prompts.parquet", heldout="data/toy_prompts_heldout.parquet",
        updates=2, override=[],
    )  # fmt: skip
    k1 = to_config(compose_miniverl_side(args, 1, *SIDES["miniverl_k1"].overrides)).estimator
    full = to_config(compose_miniverl_side(args, 1, *SIDES["miniverl_full"].overrides)).estimator
    assert (k1.loss_mode, k1.advantage_baseline) == ("k1", "batch_mean")
    assert (full.loss_mode, full.advantage_baseline) == ("reverse_kl_full", "none")
    # Without the side's reset the recipe's baseline reaches a loss that has no advantage: refused.
    with pytest.raises(MiniverlError, match="set estimator.advantage_baseline=none"):
        to_config(compose(args, 1, "estimator=reverse_kl_full"))


def test_quality_needs_the_users_models():
    from miniverl.bench.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--quality"])


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--seeds", "3"], "--seeds sets bench --quality: add --quality, or leave it out"),
        (
            ["--objective", "k1", "--updates", "5"],
            "--updates, --objective set bench --quality: add --quality, or leave",
        ),
        (["--override", "data.shuffle=true"], "--override sets bench --quality"),
        (["--scale", "toy", "--repeats", "-1"], "--repeats -1: give at least 1 timed round"),
        (["--scale", "toy", "--repeats", "0"], "--repeats 0: give at least 1 timed round"),
        (["--scale", "toy", "--logprob-chunk", "0"], "--logprob-chunk 0: give at least 1 position"),  # a traceback
    ],
)
def test_options_the_speed_bench_would_not_read_are_refused_in_one_line(argv, said, capsys):
    """A user who forgot --quality waited minutes for the speed bench, the options unread (a new-user audit);
    --repeats -1 ended in a traceback and 0 meant the default."""
    from miniverl.bench.cli import parse_args

    with pytest.raises(SystemExit) as error:
        parse_args(argv)
    assert error.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "said"),
    [("data.shufle=true", "data.shufle"), ("actor.optim.lr=-1", "actor.optim.lr=-1.0 must be")],
)
@pytest.mark.slow
def test_a_mistaken_override_ends_in_one_line_before_anything_trains(tmp_path, override, said):
    done, out = run_quality(tmp_path, "--override", override, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not (out / "runs").exists()  # nothing trained
