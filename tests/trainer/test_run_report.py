"""The report: every field of the reference report, with the same types; the out-of-memory
downshift trains exactly as a run without it; a failure is reported, not hidden; and
`report compare` reads two real runs."""

from __future__ import annotations

import json
import statistics
import sys
import weakref

import pytest
import torch
from safetensors.torch import load_file

from miniverl import report as compare_command
from miniverl.config import to_config
from miniverl.trainer import run_report as report_module
from miniverl.trainer.runner import run
from miniverl.utils import downshift
from miniverl.utils.errors import MiniverlError

from conftest import ROOT, SHORT, compose_config

REFERENCE = json.loads((ROOT / "recipes/opd_k1/reference-report-rtx4080.json").read_text())
# Fields that may be null, and why (docs/report.md says the same).
NULLABLE = {
    "hardware.cuda_runtime": "no CUDA on a CPU run",
    "hardware.driver": "no GPU driver on a CPU run",
    "hardware.gpu": "no GPU on a CPU run",
    "hardware.vram_gib": "no GPU on a CPU run",
    "measurements.peak_allocated_gib": "CUDA allocator figure",
    "measurements.peak_reserved_gib": "CUDA allocator figure",
    "resource_contract.gpu_hour_limit": "the hardware option sets no limit",
    "resource_contract.peak_reserved_limit_gib": "the hardware option sets no limit",
    "resource_contract.peak_reserved_within_limit": "no limit or no CUDA figure",
    "resource_contract.total_gpu_workload_seconds": "no GPU on a CPU run",
    "models.student.revision": "toy models have no revision",
    "models.teacher.revision": "toy models have no revision",
    "source_commit": "not run from a git checkout",
}


def kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def walk(reference: dict, ours: dict, prefix: str = ""):
    for key, ref_value in reference.items():
        path = f"{prefix}{key}"
        assert key in ours, f"report field {path} is missing"
        value = ours[key]
        if ref_value is None or (value is None and path in NULLABLE):
            continue
        assert kind(value) == kind(ref_value), f"{path}: {kind(value)} where the reference has {kind(ref_value)}"
        if isinstance(ref_value, dict) and path not in ("artifacts.checkpoint_hashes",):
            walk(ref_value, value, path + ".")


def test_the_report_has_every_field_of_the_reference_report_with_the_same_types(recipe_run):
    result, run_dir = recipe_run
    assert result.returncode == 0, result.stderr
    ours = json.loads((run_dir / "report.json").read_text())
    walk(REFERENCE, ours)
    assert set(ours["artifacts"]["checkpoint_hashes"]) == set(REFERENCE["artifacts"]["checkpoint_hashes"])


def test_the_report_figures_are_measured(recipe_run):
    _, run_dir = recipe_run
    ours = json.loads((run_dir / "report.json").read_text())
    m = ours["measurements"]
    assert (
        0 < m["cold_startup_seconds"] < m["time_to_first_rollout_seconds"] < m["time_to_first_teacher_targets_seconds"]
    )
    assert m["time_to_first_teacher_targets_seconds"] < m["time_to_first_update_seconds"]
    assert m["peak_rss_gib"] > 0.05 and m["peak_reserved_gib"] is None  # a CPU run: no invented CUDA figure
    assert m["adapter_bytes"] == sum(p.stat().st_size for p in (run_dir / "peft_adapter").iterdir())
    assert m["checkpoint_bytes"] == sum(p.stat().st_size for p in (run_dir / "checkpoints/update_3").iterdir())
    assert m["total_run_bytes"] < ours["artifacts"]["total_workload_bytes"]  # the resume check's runs count too
    assert m["prompts_consumed"] == 12 and m["distinct_prompts_consumed"] == 12
    assert m["observed_rollout_physical_batch_sizes"] == [4]
    assert m["batch_downshifts"] == {"rollout_oom": 0, "update_chunk_oom": 0}
    assert all(v > 0 for v in m["steady_state_median_seconds"].values())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = [x["response_length/sum"] / x["timing_s/gen"] for x in lines[1:]]  # update 1 excluded
    assert m["steady_state_median_throughput"]["rollout_tokens_per_second"] == pytest.approx(
        statistics.median(tokens), rel=1e-4
    )
    assert m["steady_state_median_seconds"]["actor_update"] == pytest.approx(
        statistics.median(x["timing_s/update_actor"] for x in lines[1:]), abs=1e-4
    )
    pi = ours["profile_identity"]
    assert pi["digest"] == report_module.sha256_json({k: v for k, v in pi.items() if k != "digest"})
    assert ours["resume"]["status"] == "exact_match"
    assert ours["resource_contract"]["total_workload_seconds"] > 0
    # Which files trained it, beside the digest of their bytes (`report compare` could not name them).
    assert ours["recipe"]["train_files"] == ["data/toy_prompts.parquet"]


def run_toy(tmp_path, name, *extra):
    cfg = compose_config(["+recipe=opd_k1", *SHORT, "recipe.optimizer_updates=2", *extra])
    return run(cfg, tmp_path / name)


@pytest.fixture(scope="module")
def plain_and_downshifted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("oom")
    return (run_toy(tmp, "plain"), tmp / "plain"), (
        run_toy(tmp, "oom", "hardware.simulate_oom_above_rows=1"),
        tmp / "oom",
    )


@pytest.mark.slow
def test_an_oom_at_4_and_at_2_runs_at_1_and_trains_the_same(plain_and_downshifted):
    (plain, plain_dir), (shifted, shifted_dir) = plain_and_downshifted
    m = shifted["measurements"]
    assert m["batch_downshifts"] == {"rollout_oom": 2, "update_chunk_oom": 2}
    assert m["observed_rollout_physical_batch_sizes"] == [1]
    assert plain["measurements"]["observed_rollout_physical_batch_sizes"] == [4]
    for update in (1, 2):
        a = load_file(str(plain_dir / "trajectories" / f"update_{update:06d}.safetensors"))
        b = load_file(str(shifted_dir / "trajectories" / f"update_{update:06d}.safetensors"))
        assert torch.equal(a["responses"], b["responses"])  # same tokens
        for key in ("rollout_log_probs", "teacher_logprobs", "old_log_probs"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5)
    plain_loss = [
        json.loads(x)["actor/distillation/loss"] for x in (plain_dir / "metrics.jsonl").read_text().splitlines()
    ]
    shifted_loss = [
        json.loads(x)["actor/distillation/loss"] for x in (shifted_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert shifted_loss == pytest.approx(plain_loss, rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_an_oom_at_one_row_fails_keeps_the_last_update_and_reports_failed(tmp_path, monkeypatch):
    from miniverl.workers.rollout import RolloutWorker

    real = RolloutWorker.generate_sequences
    calls = {"n": 0}

    def second_update_never_fits(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(RolloutWorker, "generate_sequences", second_update_never_fits)
    with pytest.raises(MiniverlError, match="update 2 failed: out of memory in a rollout of a single row"):
        run_toy(tmp_path, "run", "trainer.save_freq=-1")
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "failed" and report["failure"]["update"] == 2
    assert report["measurements"]["batch_downshifts"]["rollout_oom"] == 2
    assert (tmp_path / "run" / "checkpoints" / "update_1" / "state.json").is_file()


def test_the_plans_sizes_are_used_until_a_downshift_splits_the_rows_at_the_halved_size():
    shift = downshift.Downshift(torch.device("cpu"), rollout_rows=4, update_rows=4, simulate_above=3)
    assert shift.run("update_chunk", [3, 1], lambda sizes: sizes) == [3, 1]  # plan.json's, not split(4, 4)
    assert shift.run("rollout", [4, 2], lambda sizes: sizes) == [2, 2, 2]  # 4 rows > 3: halved to 2
    assert shift.counts == {"rollout_oom": 1, "update_chunk_oom": 0}


def test_the_failed_attempt_is_released_before_the_cache_is_freed_and_the_rows_halved(monkeypatch):
    at_free = []
    attempts = []

    def record(device):
        at_free.append((sys.exc_info(), attempts[-1]() is None))

    def work(sizes):
        activations = torch.ones(max(sizes), 256)  # what a failed forward leaves behind
        attempts.append(weakref.ref(activations))
        if max(sizes) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return sizes

    monkeypatch.setattr(downshift, "free_device_cache", record)
    shift = downshift.Downshift(torch.device("cpu"), rollout_rows=4, update_rows=4, simulate_above=None)
    assert shift.run("rollout", [4], work) == [1, 1, 1, 1]
    # Both times outside the except block, with the failed attempt's tensors already gone.
    assert at_free == [((None, None, None), True)] * 2
    assert shift.counts["rollout_oom"] == 2 and shift.rows["rollout"] == 1


@pytest.mark.slow
def test_an_oom_halves_the_rows_that_failed_not_a_larger_configured_size(tmp_path):
    """A plan of 4-row rollouts under hardware.rollout_physical_batch=16: the first out-of-memory
    error halves to 2 at once, not 16 -> 8 -> 4 -> 2 through two retries of the same 4 rows."""
    report = run_toy(tmp_path, "big", "hardware.rollout_physical_batch=16", "hardware.simulate_oom_above_rows=2")
    assert report["measurements"]["batch_downshifts"]["rollout_oom"] == 1
    assert report["measurements"]["observed_rollout_physical_batch_sizes"] == [2]


def test_an_oom_in_the_held_out_probe_halves_its_rows_too(tmp_path, monkeypatch):
    from miniverl.workers.rollout import RolloutWorker
    from miniverl.workers.teacher import TeacherWorker

    rollout_rows, teacher_rows = [], []
    real_rollout, real_teacher = RolloutWorker.generate_sequences, TeacherWorker.compute_teacher_log_prob

    def rollout(self, *args, physical_batches, **kwargs):
        rollout_rows.extend(physical_batches)
        return real_rollout(self, *args, physical_batches=physical_batches, **kwargs)

    def teacher(self, batch, rows):
        teacher_rows.append(rows)
        return real_teacher(self, batch, rows)

    monkeypatch.setattr(RolloutWorker, "generate_sequences", rollout)
    monkeypatch.setattr(TeacherWorker, "compute_teacher_log_prob", teacher)
    report = run_toy(
        tmp_path,
        "probe",
        "hardware.simulate_oom_above_rows=1",
        "data.val_files=data/toy_prompts_heldout.parquet",
        "eval.every=2",
    )
    assert report["status"] == "measured"
    # The probe (update 0) halves its own rows 4 -> 2 -> 1, and training its own at update 1: the report
    # counts both, and training's sizes stay untouched by the probe (tests/e2e/test_resume.py) ...
    assert report["measurements"]["batch_downshifts"] == {"rollout_oom": 4, "update_chunk_oom": 4}
    # ... and no forward of the run, the probe's included, ever held more than one row.
    assert set(rollout_rows) == {1} and set(teacher_rows) == {1}
    assert [p["update"] for p in report["distillation_progress"]["k1_mean"]] == [0, 2]


def test_report_compare_prints_both_runs_side_by_side(plain_and_downshifted, capsys):
    (_, plain_dir), (_, shifted_dir) = plain_and_downshifted
    assert compare_command.main(["compare", str(plain_dir / "report.json"), str(shifted_dir / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "measurements.steady_state_median_seconds.rollout" in out
    assert "measurements.batch_downshifts.rollout_oom" in out
    line = next(x for x in out.splitlines() if x.startswith("measurements.prompts_consumed"))
    assert line.split()[1:] == ["8", "8", "1.000"]
    assert "identity fields that differ:" in out and "run_identity.resolved_config_digest" in out
    # What the digests do not say: the one setting the two commands changed (and none outside the plan).
    assert out.strip().splitlines()[-4:] == [
        "settings that differ (plan.json): 1",
        "  hardware.simulate_oom_above_rows: null | 1",
        "",
        "other config that differs (resolved_config.yaml, outside the plan): 0",
    ]


def test_report_compare_refuses_a_file_that_is_not_a_report(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    assert compare_command.main(["compare", str(bad), str(bad)]) == 2
    assert "not a readable report" in capsys.readouterr().err


def test_tensorboard_logger_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    run_toy(tmp_path, "tb", "trainer.logger=[console,jsonl,tensorboard]")
    assert list((tmp_path / "tb" / "tensorboard").glob("events.out.tfevents.*"))


def test_the_steady_state_of_one_update_is_null_not_the_warm_up_update():
    """A new-user audit: with one update the "steady-state" rollout was update 1's (0.83 s against 0.11 s a
    steady update): docs/report.md says these are medians over updates 2..N, null where they do not exist."""
    update = {"timing_s/gen": 0.83, "timing_s/teacher": 0.2, "timing_s/update_actor": 0.5, "response_length/sum": 64}
    seconds, throughput = report_module.steady_state([update])
    assert set(seconds.values()) == {None} and set(throughput.values()) == {None}
    steady = {**update, "timing_s/gen": 0.11}
    seconds, throughput = report_module.steady_state([update, steady, steady])
    assert seconds["rollout"] == 0.11 and throughput["rollout_tokens_per_second"] == round(64 / 0.11, 4)


@pytest.mark.parametrize(
    "device,reserved,limits,within",
    [
        ("cuda", 1.0, ["hardware.peak_reserved_limit_gib=0.5", "hardware.gpu_hour_limit=0.25"], (False, False)),
        ("cuda", 1.0, ["hardware.peak_reserved_limit_gib=2", "hardware.gpu_hour_limit=1"], (True, True)),
        ("cuda", 1.0, ["hardware.peak_reserved_limit_gib=1", "hardware.gpu_hour_limit=0.5"], (True, True)),
        ("cuda", 1.0, [], (None, None)),  # no limit: nothing to judge
        ("cpu", None, ["hardware.gpu_hour_limit=0.25"], (None, None)),  # no GPU hours on the CPU
    ],
)
def test_the_resource_contract_judges_the_measured_figures_against_the_limits(device, reserved, limits, within):
    """`peak_reserved_within_limit` and `gpu_hours_within_limit` had no test of their value (a tests audit);
    a run of half an hour, 1 GiB reserved, at and on either side of each limit."""
    from dataclasses import fields

    cfg = to_config(compose_config(["+recipe=opd_k1", *SHORT, *limits]))
    given = {"hardware": {"device": device}, "peak_reserved_gib": reserved, "workload_seconds": 1800.0}
    facts = report_module.RunFacts(**{f.name: given.get(f.name) for f in fields(report_module.RunFacts)})
    contract = report_module.resource_contract(cfg, facts)
    assert (contract["peak_reserved_within_limit"], contract["gpu_hours_within_limit"]) == within


def test_prompts_read_again_count_once_among_the_distinct_ones(tmp_path):
    """4 prompts, 3 updates of 4 with data.repeat_prompts: 12 consumed, 4 distinct (the suite's runs
    never repeated a prompt, so a count of every row passed as the distinct one: a tests audit)."""
    import pyarrow.parquet as pq

    four = tmp_path / "four.parquet"
    pq.write_table(pq.read_table(ROOT / "data" / "toy_prompts.parquet").slice(0, 4), four)
    report = run_toy(tmp_path, "run", f"data.train_files=[{four}]", "data.repeat_prompts=true",
                     "recipe.logical_batch=4", "recipe.optimizer_updates=3")  # fmt: skip
    m = report["measurements"]
    assert (m["prompts_consumed"], m["distinct_prompts_consumed"]) == (12, 4)
