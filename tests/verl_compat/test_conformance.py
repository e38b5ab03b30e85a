"""miniverl.losses reproduces verl's OPD losses on the golden vectors (v0.8.0 and v0.9.1), and the checker bites."""

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
    assert captured.err.startswith("miniverl.conformance: error: ")  # every command's form (docs/troubleshooting.md)
    assert captured.err.strip().endswith("the golden files are tests/data/verl-*.json")  # where to look


@pytest.mark.parametrize("rtol", ["-1", "nan"])
def test_a_tolerance_that_fails_every_case_is_refused(rtol, capsys):
    """A new-user audit's --rtol -1 (and nan) reported 0/54 matching, "expected 0.0515… got 0.0515…"."""
    with pytest.raises(SystemExit) as refused:
        main([str(GOLDEN), "--rtol", rtol])
    assert refused.value.code == 2 and f"--rtol {float(rtol)}: give a tolerance of 0 or more" in capsys.readouterr().err


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


# --------------------------------------------------------------------------------------------------
# verl v0.9.1 (scripts/make_opd_loss_goldens.py run with verl 0.9.1)
# --------------------------------------------------------------------------------------------------

GOLDEN_091 = DATA / "verl-0.9.1-opd-loss.json"


def _golden_091() -> dict:
    return json.loads(GOLDEN_091.read_text())


def _token_sum_cases(data: dict) -> set[int]:
    return {i for i, c in enumerate(data["cases"]) if c["loss_agg_mode"] == "token-sum"}


def test_the_0_9_1_file_covers_token_sum_and_chunked_topk():
    data = _golden_091()
    assert data["verl_version"] == "0.9.1" and data["dtype"] == "float64"
    token_sum = [data["cases"][i] for i in _token_sum_cases(data)]
    assert {(c["kind"], c["use_policy_gradient"]) for c in token_sum} == {
        ("estimator", True),
        ("estimator", False),
        ("forward_kl_topk", False),
    }
    chunked = [c for c in data["cases"] if c.get("use_chunked_topk")]
    sizes = {c["chunked_topk_chunk_size"] for c in chunked}
    positions = {len(c["inputs"]["response_mask"]) * len(c["inputs"]["response_mask"][0]) for c in chunked}
    assert any(n % s for s in sizes for n in positions)  # a chunk size that does not divide B*T


@pytest.mark.parametrize("dtype_args", [[], ["--dtype", "float32", "--rtol", "1e-5"]])
def test_all_0_9_1_golden_cases_match_and_the_version_comes_from_the_file(capsys, dtype_args):
    n = len(_golden_091()["cases"])
    assert main([str(GOLDEN_091), *dtype_args]) == 0
    out = capsys.readouterr().out
    assert _last_line(out) == f"conformance: {n}/{n} cases match verl v0.9.1"
    assert not re.search(r"^case \d+ ", out, re.MULTILINE)


def test_wrong_token_sum_aggregation_fails_exactly_the_token_sum_cases(monkeypatch, capsys):
    import miniverl.workers.losses as losses

    agg_loss = losses.agg_loss

    def token_sum_as_token_mean(loss_mat, loss_mask, loss_agg_mode, **norms):
        mode = "token-mean" if loss_agg_mode == "token-sum" else loss_agg_mode
        return agg_loss(loss_mat, loss_mask, mode, **norms)

    monkeypatch.setattr(losses, "agg_loss", token_sum_as_token_mean)
    data = _golden_091()
    assert main([str(GOLDEN_091)]) == 1
    out = capsys.readouterr().out
    failed = {int(i) for i in re.findall(r"^case (\d+) \(.*\): loss:", out, re.MULTILINE)}
    assert failed == _token_sum_cases(data) and len(failed) >= 3


def test_a_corrupted_chunked_topk_gradient_is_reported(tmp_path, capsys):
    data = _golden_091()
    index = next(i for i, c in enumerate(data["cases"]) if c.get("use_chunked_topk"))
    data["cases"][index]["expected"]["grad_student_logits"][0][1][2] += 0.01
    bad = tmp_path / "corrupted.json"
    bad.write_text(json.dumps(data))
    assert main([str(bad)]) == 1
    line = rf"^case {index} \(forward_kl_topk k=\d+ .* chunked=\d+\): grad_student_logits: .* \(at \[0, 1, 2\]"
    assert re.search(line, capsys.readouterr().out, re.MULTILINE)


def test_refusals_of_0_9_1_are_checked_and_release_specific_answers_are_left_to_the_export(capsys):
    data = _golden_091()
    assert main([str(GOLDEN_091)]) == 0
    out = capsys.readouterr().out
    checked = [e for e in data["refused"] if "export_only" not in e]
    assert len(checked) == len(data["refused"]) == 6
    assert any(e.get("chunked_topk_chunk_size") == 0 for e in checked)
    (temperature,) = [e for e in data["warned"] if "export_only" in e]
    assert "inference.temperature" in next(iter(temperature["verl_overrides"]))
    assert f"refused: 6/6 configurations refused as in verl; warned: {len(data['warned']) - 1}/" in out
    assert re.search(r"^warned 1 \(distillation\..*temperature=0\.7\): left to the export to verl v0\.9\.1", out, re.M)


def test_an_export_only_refusal_is_listed_not_checked_and_a_checked_one_still_bites(tmp_path, capsys):
    # verl 0.8.0 refuses token-sum, 0.9.1 accepts it: miniverl's config (one for every release)
    # accepts it, and the entry of a 0.8.0 file says that only the export can refuse it.
    data = _golden()
    token_sum = {"loss_mode": "k3", "use_policy_gradient": False, "loss_agg_mode": "token-sum"}
    data["refused"].append({**token_sum, "verl": "ValueError: Invalid loss_agg_mode", "export_only": "0.9 has it"})
    path = tmp_path / "with_export_only.json"
    path.write_text(json.dumps(data))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "refused: 4/4 configurations refused as in verl; warned: 1/1 accepted with a warning; 1 left" in out
    assert _last_line(out) == f"conformance: {N_CASES}/{N_CASES} cases match verl v0.8.0"
    data["refused"][-1].pop("export_only")
    path.write_text(json.dumps(data))
    assert main([str(path)]) == 1
    assert "MISMATCH: accepted; verl refuses it" in capsys.readouterr().out


@pytest.mark.parametrize(
    "fields, version",
    [
        ({"verl_version": "0.9.1", "source": "verl v0.8.0 (commit x)"}, "v0.9.1"),
        ({"verl_version": "v0.10.0"}, "v0.10.0"),
        ({"source": "verl v0.9.0: core_algos.agg_loss"}, "v0.9.0"),
        ({"source": "computed by hand"}, "v0.8.0"),
        ({}, "v0.8.0"),
    ],
)
def test_the_version_printed_is_the_files(tmp_path, capsys, fields, version):
    from miniverl.verl_compat.conformance import golden_version

    assert golden_version(fields) == version
    path = tmp_path / "golden.json"
    path.write_text(json.dumps({**fields, "cases": _golden()["cases"][:2]}))
    assert main([str(path)]) == 0
    assert _last_line(capsys.readouterr().out) == f"conformance: 2/2 cases match verl {version}"


@pytest.mark.parametrize("release", ["0.8.0", "0.9.1"])
def test_verls_reward_rules_of_each_release_are_scored_as_that_release_scores_them(capsys, release):
    """verl 0.9.1 added a \\boxed fallback to the DAPO rule; its file is scored by miniverl's rules as
    they are, the 0.8.0 file with 0.8.0's DAPO rule (the same strings score differently there)."""
    assert main([str(DATA / f"verl-{release}-reward-rules.json")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"conformance: 65/65 cases match verl v{release}"
