"""`python -m miniverl.report compare A B`: two reports side by side, from their files or run folders."""

from __future__ import annotations

import json

from miniverl.report import main

REPORT_A = {
    "schema_version": 1,
    "measurements": {"rollout": {"tokens_per_second": 100.0}},
    "recipe": {"estimator": "k1"},
    "measured_at": "2026-12-05T10:00:00",
}
REPORT_B = {
    "schema_version": 1,
    "measurements": {"rollout": {"tokens_per_second": 150.0}},
    "recipe": {"estimator": "k3"},
    "measured_at": "2026-12-05T11:00:00",
}


def test_compare_takes_report_files_or_run_folders_and_shows_b_over_a_and_what_differs(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "report.json").write_text(json.dumps(REPORT_A))
    (tmp_path / "b.json").write_text(json.dumps(REPORT_B))
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith("measurements.rollout.tokens_per_second"))
    assert row.split()[-1] == "1.500"
    assert "identity fields that differ: 1" in lines  # the clock is not an identity
    assert lines[-1].split() == ["recipe.estimator:", "k1", "|", "k3"]


def test_a_json_file_that_is_no_report_is_one_line(tmp_path, capsys):
    (tmp_path / "b.json").write_text(json.dumps(REPORT_B))
    (tmp_path / "plan.json").write_text('{"updates": []}')  # JSON, but not a report: before, a table of nulls
    assert main(["compare", str(tmp_path / "plan.json"), str(tmp_path / "b.json")]) == 2
    assert capsys.readouterr().err == (
        f"miniverl: error: {tmp_path / 'plan.json'}: not a miniverl report (no schema_version); give a run's "
        "report.json or its folder\n"
    )


def test_a_report_of_another_schema_version_is_refused_in_one_line(tmp_path, capsys):
    from miniverl import __version__

    (tmp_path / "b.json").write_text(json.dumps(REPORT_B))
    (tmp_path / "later.json").write_text('{"schema_version": 99}')  # before, a table of nulls, no word
    assert main(["compare", str(tmp_path / "b.json"), str(tmp_path / "later.json")]) == 2
    assert capsys.readouterr().err == (
        f"miniverl: error: {tmp_path / 'later.json'}: a report of schema_version 99; this miniverl ({__version__}) "
        "reads schema_version 1: compare with the release that wrote it\n"
    )


def test_a_folder_without_a_report_is_one_line(tmp_path, capsys):
    (tmp_path / "b.json").write_text(json.dumps(REPORT_B))
    assert main(["compare", str(tmp_path), str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"miniverl: error: {tmp_path / 'report.json'}: not a readable report") and err.count("\n") == 1
    )


def test_a_resume_and_its_twin_differ_in_no_identity_field_only_in_the_timings_state_json_records(capsys):
    from miniverl.report import compare

    def report(state_hash, adapter_hash):
        hashes = {"adapter.safetensors": adapter_hash, "optimizer.safetensors": "o", "state.json": state_hash}
        trained = {"trajectory_sha256": f"t{adapter_hash}", "standard_peft_adapter_sha256": adapter_hash}
        return {**REPORT_A, "artifacts": {"checkpoint_hashes": hashes, **trained}}

    twins = compare(report("s1", "a"), report("s2", "a"))  # byte-exact: only state.json's timings differ
    assert "identity fields that differ: 0" in twins
    assert "training: the same, bit for bit (trajectory_sha256 and standard_peft_adapter_sha256 are equal)" in twins
    assert any("artifacts.checkpoint_hashes.state.json" in line and "timings" in line for line in twins)
    parted = compare(report("s1", "a"), report("s2", "b"))  # other weights: an identity that differs
    assert "identity fields that differ: 3" in parted
    assert "  artifacts.checkpoint_hashes.adapter.safetensors: a | b" in parted
    assert "training: differs (trajectory_sha256 and standard_peft_adapter_sha256 differ)" in parted
    assert "training: not compared (a report lacks trajectory_sha256 or the adapter's sha256)" in compare(
        REPORT_A, REPORT_B
    )


def test_a_setting_outside_the_plan_that_differs_is_named_from_the_resolved_configs(tmp_path, capsys):
    """A new-user audit compared runs of eval.every=2 and -1: it showed only among the identity fields' digests
    (eval.* is not part of the plan, whose settings the comparison listed)."""
    for name, every in (("a", 2), ("b", -1)):
        run = tmp_path / name
        run.mkdir()
        (run / "report.json").write_text(json.dumps(REPORT_A))
        (run / "plan.json").write_text(json.dumps({"settings": {"actor": {"optim": {"lr": 1e-5}}}}))
        (run / "resolved_config.yaml").write_text(f"actor:\n  optim:\n    lr: 1.0e-05\neval:\n  every: {every}\n")
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-4:] == [
        "settings that differ (plan.json): 0",
        "",
        "other config that differs (resolved_config.yaml, outside the plan): 1",
        "  eval.every: 2 | -1",
    ]


def test_a_report_compared_with_itself_says_so(tmp_path, capsys):
    """A new-user audit compared a run with itself: every ratio 1, "training: the same, bit for bit", no word."""
    (tmp_path / "report.json").write_text(json.dumps(REPORT_A))
    assert main(["compare", str(tmp_path), str(tmp_path / "report.json")]) == 0
    assert "note: A and B are the same report" in capsys.readouterr().out.splitlines()
