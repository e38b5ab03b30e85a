"""The sweep summary's plot: every job visible, even where two jobs' losses draw one line."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image

from miniverl import sweep_summary


def job(number: int, swept: str, losses: list[float]) -> tuple[dict, list[float]]:
    return {"job": str(number), "swept": swept, "status": "measured"}, losses


def test_a_job_drawn_on_an_earlier_jobs_line_says_so_in_the_legend(tmp_path):
    # A sweep over model.lora.r=8,16 on k1 and k3: r barely moves the toy's first updates' losses
    # (job 1 as measured: 0.03254 vs 0.032546 after update 3); job 4 is apart by 1% of the axis.
    jobs = [
        job(0, "estimator=k1 model.lora.r=8", [0.00350, 0.02024, 0.03254]),
        job(1, "estimator=k1 model.lora.r=16", [0.00350, 0.02024, 0.032546]),
        job(2, "estimator=k3 model.lora.r=8", [0.010, 0.008, 0.006]),
        job(3, "estimator=k3 model.lora.r=16", [0.010, 0.008, 0.006]),
        job(4, "estimator=k3 model.lora.r=32", [0.010, 0.008, 0.0063]),
    ]
    assert sweep_summary.legend_labels(jobs) == [
        "#0 estimator=k1 model.lora.r=8",
        "#1 estimator=k1 model.lora.r=16 (on the line of #0)",
        "#2 estimator=k3 model.lora.r=8",
        "#3 estimator=k3 model.lora.r=16 (on the line of #2)",
        "#4 estimator=k3 model.lora.r=32",
    ]
    sweep_summary.plot([(*one, []) for one in jobs], tmp_path / "sweep_summary.png")  # no held-out KL: one panel
    assert matplotlib.image.imread(str(tmp_path / "sweep_summary.png")).shape[:2] == (450, 800)


def test_a_job_not_measured_to_its_end_says_its_status_in_the_legend():
    jobs = [job(0, "estimator=k1", [0.1, 0.2]), job(1, "estimator=k3", [0.3])]
    jobs[1][0]["status"] = "interrupted"  # a signal stopped it (the sweep stopped with it)
    assert sweep_summary.legend_labels(jobs) == ["#0 estimator=k1", "#1 estimator=k3 (interrupted)"]


def test_a_job_whose_report_a_crash_cut_short_is_listed_as_unreadable(tmp_path):
    job = tmp_path / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- estimator=k1\n")
    (job / "report.json").write_text("{oops")  # before: a JSONDecodeError traceback
    row, losses, _ = sweep_summary.summarize_job(job, sweep_summary.job_overrides(job))
    assert (row["status"], row["error"], losses) == (
        "report unreadable",
        f"{job / 'report.json'} is not valid JSON",
        [],
    )


def test_a_missing_or_empty_sweep_folder_is_one_line_saying_which(tmp_path, capsys):
    from miniverl.sweep_summary import main

    fix = "give the sweep's hydra.sweep.dir (the folder of multirun.yaml and the numbered job folders)\n"
    assert main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == (
        f"miniverl: error: {tmp_path / 'nope'}: no such folder (relative to {Path.cwd()}); " + fix
    )
    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")  # a new-user audit gave the file: "no such folder"
    assert main([str(tmp_path / "multirun.yaml")]) == 2
    assert capsys.readouterr().err == f"miniverl: error: {tmp_path / 'multirun.yaml'}: is a file, not a folder; " + fix
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"miniverl: error: {tmp_path} holds no Hydra job folders")
    (tmp_path / "report.json").write_text("{}")  # a single run's folder
    assert main([str(tmp_path)]) == 2
    assert "(a single run's folder: its report.md is its summary); give the sweep's" in capsys.readouterr().err
    runs = tmp_path / "outputs" / "2026-12-07"  # a sweep audit: single runs' folders got a summary written there
    (runs / "10-00-00" / ".hydra").mkdir(parents=True)
    (runs / "10-00-00" / ".hydra" / "overrides.yaml").write_text("- estimator=k1\n")
    assert main([str(runs)]) == 2
    assert capsys.readouterr().err == (
        f"miniverl: error: {runs} has no multirun.yaml, so it is no sweep's folder (nothing written there); " + fix
    )
    assert sorted(p.name for p in runs.iterdir()) == ["10-00-00"]


def test_the_held_out_kl_tells_jobs_apart_where_a_centred_policy_gradients_loss_is_zero(tmp_path):
    """With estimator.advantage_baseline the PG loss is ~0 in every job (a new-user audit's sweep: -3e-9,
    -2e-8): the summary lists each job's last held-out exact reverse KL and plots it beside the loss."""
    import json

    for number, (lr, kls) in enumerate([("1e-2", [2.3, 1.9, 1.1]), ("1e-4", [2.3, 2.2, 2.1])]):
        folder = tmp_path / str(number)
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "overrides.yaml").write_text(f"- +recipe=opd_k1_real_cpu\n- actor.optim.lr={lr}\n")
        losses = [{"actor/distillation/loss": v} for v in (-3.1e-9, 1.4e-8, 4.0e-8, -2.5e-8)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in losses))
        progress = {"exact_reverse_kl": [{"update": u, "value": v} for u, v in zip((0, 2, 4), kls)]}
        report = {"status": "measured", "distillation_progress": progress, "resume": {"status": "not_checked"}}
        report["measurements"] = {"peak_reserved_gib": None, "peak_rss_gib": 2.0, "steady_state_median_throughput": {}}
        (folder / "report.json").write_text(json.dumps(report))
    rows = sweep_summary.write_summary(tmp_path)
    assert [(row["swept"], row["heldout_kl"], row["heldout_kl_update"]) for row in rows] == [
        ("actor.optim.lr=1e-2", 1.1, 4),
        ("actor.optim.lr=1e-4", 2.1, 4),
    ]
    assert "| heldout_kl | heldout_kl_update |" in (tmp_path / "sweep_summary.md").read_text()
    assert matplotlib.image.imread(str(tmp_path / "sweep_summary.png")).shape[:2] == (450, 1400)  # two panels


def test_job_folders_come_in_hydras_numbers_order_not_as_text(tmp_path):
    """Job 10 after job 2 (a tests audit: no test sweep had ten jobs, and text order passed)."""
    for name in ("10", "2", "0", "custom"):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "overrides.yaml").write_text("- estimator=k1\n")
    assert [job.name for job in sweep_summary.job_dirs(tmp_path)] == ["0", "2", "10", "custom"]
