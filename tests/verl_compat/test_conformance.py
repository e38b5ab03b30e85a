"""miniverl.losses reproduces verl v0.8.0's OPD losses on the golden vectors, and the checker bites."""

from __future__ import annotations

import json
import re

import pytest

from miniverl.config.estimator import EstimatorConfig
from miniverl.conformance import main

from conftest import DATA

GOLDEN = DATA / "verl-0.8.0-opd-loss.json"
N_CASES = 54


def _golden() -> dict:
    return json.loads(GOLDEN.read_text())


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_all_54_golden_cases_match_verl_in_float64(capsys):
    assert main([str(GOLDEN)]) == 0
    out = capsys.readouterr().out
    assert _last_line(out) == f"conformance: {N_CASES}/{N_CASES} cases match verl v0.8.0"
    assert not re.search(r"^case \d+ ", out, re.MULTILINE)


def test_all_golden_cases_match_verl_in_float32_within_1e5(capsys):
    assert main([str(GOLDEN), "--dtype", "float32", "--rtol", "1e-5"]) == 0
    assert _last_line(capsys.readouterr().out) == f"conformance: {N_CASES}/{N_CASES} cases match verl v0.8.0"


def test_a_corrupted_expected_value_is_reported_as_a_mismatch(tmp_path, capsys):
    data = _golden()
    assert data["cases"][3]["loss_agg_mode"] == "seq-mean-token-sum-norm"
    data["cases"][3]["expected"]["loss"] *= 1.001
    bad = tmp_path / "corrupted.json"
    bad.write_text(json.dumps(data))
    assert main([str(bad)]) == 1
    out = capsys.readouterr().out
    line = r"^case 3 \(k1 pg seq-mean-token-sum-norm clamp=10.0\): loss: expected \S+ got \S+$"
    assert re.search(line, out, re.MULTILINE)
    assert _last_line(out) == f"conformance: {N_CASES - 1}/{N_CASES} cases match verl v0.8.0"


def test_a_corrupted_gradient_element_is_reported_with_its_position(tmp_path, capsys):
    data = _golden()
    data["cases"][50]["expected"]["grad_student_logits"][1][2][3] += 0.01
    bad = tmp_path / "corrupted.json"
    bad.write_text(json.dumps(data))
    assert main([str(bad)]) == 1
    out = capsys.readouterr().out
    line = r"^case 50 \(forward_kl_topk k=4 token-mean\): grad_student_logits: expected .* \(at \[1, 2, 3\]"
    assert re.search(line, out, re.MULTILINE)


@pytest.mark.parametrize("content", [None, "{not json", '{"cases": 3}'])
def test_missing_or_invalid_file_exits_2_with_one_line_and_no_traceback(tmp_path, capsys, content):
    path = tmp_path / "golden.json"
    if content is not None:
        path.write_text(content)
    assert main([str(path)]) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1
    assert "Traceback" not in captured.err and str(path) in captured.err


# What each refusal message must name, by the golden file's `refused` entries (in order).
REFUSAL_MESSAGES = {
    ("k1", False, None): [r"k1", r"use_policy_gradient"],
    ("k3+", True, None): [r"k3\+", r"loss_mode"],
    ("bogus", True, None): [r"bogus", r"loss_mode"],
    ("k1", True, "gspo"): [r"gspo", r"vanilla"],
}


@pytest.mark.parametrize("index", range(4))
def test_each_configuration_verl_refuses_is_refused_with_a_message_naming_the_problem(index):
    entry = _golden()["refused"][index]
    kwargs = {k: v for k, v in entry.items() if k != "verl"}
    key = (entry["loss_mode"], entry["use_policy_gradient"], entry.get("policy_loss_mode"))
    with pytest.raises((ValueError, NotImplementedError)) as info:
        EstimatorConfig(**kwargs)
    for fragment in REFUSAL_MESSAGES[key]:
        assert re.search(fragment, str(info.value)), (fragment, str(info.value))


def test_conformance_reports_the_refused_and_warned_configurations(capsys):
    main([str(GOLDEN)])
    out = capsys.readouterr().out
    assert "refused: 4/4 configurations refused as in verl; warned: 1/1 accepted with a warning" in out


def test_forward_kl_topk_with_policy_gradient_is_accepted_with_a_warning():
    (entry,) = _golden()["warned"]
    with pytest.warns(UserWarning, match="top-k"):
        est = EstimatorConfig(**entry)
    assert est.loss_mode == "forward_kl_topk" and est.use_policy_gradient


def test_dual_clip_bound_not_above_one_is_refused():
    with pytest.raises(ValueError, match=r"clip_ratio_c.*> 1"):
        EstimatorConfig(loss_mode="k1", use_policy_gradient=True, clip_ratio_c=1.0)


TASK_GOLDEN = DATA / "verl-0.8.0-task-rewards.json"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_task_rewards_match_verls_combined_loss_advantages_and_rule_scores(capsys, dtype):
    cases = json.loads(TASK_GOLDEN.read_text())["cases"]
    kinds = {c["kind"] for c in cases}
    assert kinds == {"task_ppo", "grpo_advantage", "rloo_advantage", "reward_score"}
    assert main([str(TASK_GOLDEN), "--dtype", dtype]) == 0
    out = capsys.readouterr().out
    assert _last_line(out) == f"conformance: {len(cases)}/{len(cases)} cases match verl v0.8.0"


@pytest.mark.parametrize(
    "kind, field, label",
    [
        ("task_ppo", ("expected", "metrics", "actor/pg_loss"), r"task rewards coef=1.0\): metric actor/pg_loss"),
        ("grpo_advantage", ("expected", "advantages"), r"grpo norm_by_std=True\): advantages"),
        ("reward_score", ("expected", "score"), r"reward openai/gsm8k .*\): score"),
    ],
)
def test_a_corrupted_task_reward_value_is_reported(tmp_path, capsys, kind, field, label):
    data = json.loads(TASK_GOLDEN.read_text())
    case = next(c for c in data["cases"] if c["kind"] == kind)
    holder = case
    for key in field[:-1]:
        holder = holder[key]
    value = holder[field[-1]]
    holder[field[-1]] = [[v + 0.5 for v in row] for row in value] if isinstance(value, list) else value + 0.5
    bad = tmp_path / "corrupted.json"
    bad.write_text(json.dumps(data))
    assert main([str(bad)]) == 1
    assert re.search(label, capsys.readouterr().out)
