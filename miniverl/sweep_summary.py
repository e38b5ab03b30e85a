"""Hydra multirun summary: one table and one picture beside the jobs of a sweep.

    sweep_summary.csv / .md   a row per job: overrides, status (and error), final and mean
                              distillation loss, the last held-out exact reverse KL, throughputs,
                              peak memory, resume status, run folder
    sweep_summary.png         per-update distillation loss of every job, labelled by overrides, and
                              beside it the held-out exact reverse KL where the jobs measured it

Written by a Hydra callback after every job (so a crash or a failed job loses nothing), and on
demand: `python -m miniverl.sweep_summary SWEEP_DIR` (e.g. after a crash, or across launchers).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
import sys
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from miniverl.utils.errors import MiniverlError, exit_code_of
from miniverl.utils.overrides import override_key, shell_override
from miniverl.utils.run_names import LOSS_KEY, METRICS, REPORT
from miniverl.utils.sweeps import RUN_CONTROL_KEYS, each_job, sweep_arguments
from miniverl.utils.tables import format_value

# A job's report status when every update ran: "measured", as in the reference report
# ("completed" in reports written before the status took that name).
DONE = ("measured", "completed")
COLUMNS = [
    "job",
    "swept",
    "status",
    "error",
    "final_loss",
    "mean_loss",
    # The held-out probe's last exact reverse KL and its update (eval.every): what tells the jobs' students
    # apart where the loss cannot (a policy gradient's loss is ~0 with estimator.advantage_baseline).
    "heldout_kl",
    "heldout_kl_update",
    "rollout_tokens_per_second",
    "teacher_scored_positions_per_second",
    "update_positions_per_second",
    "peak_reserved_gib",
    "peak_rss_gib",
    "resume",
    "run_dir",
    "overrides",
]


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Job folders (those with Hydra's .hydra/overrides.yaml), in job order."""
    found = [p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")]
    return sorted(found, key=lambda p: job_order(p.name))


def job_order(name: str) -> tuple[int, int | str]:
    """Hydra numbers its job folders 0, 1, ...; other names (a custom hydra.sweep.subdir) after them."""
    return (0, int(name)) if name.isdigit() else (1, name)


def job_overrides(job: Path) -> list[str]:
    return yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []


def summarize_job(job: Path, overrides: list[str]) -> tuple[dict, list[float], list[tuple[int, float]]]:
    """A job's row (`overrides`: its command line's), its loss per update and its held-out exact reverse KL
    as (update, value)."""
    from miniverl.utils.run_folder import ERROR_FILE  # imports torch: not at Hydra start-up

    row = {column: None for column in COLUMNS}
    row.update(job=job.name, overrides=" ".join(overrides), run_dir=str(job))
    losses = []
    if (job / METRICS).is_file():
        losses = [json.loads(line)[LOSS_KEY] for line in (job / METRICS).read_text().splitlines() if line.strip()]
    if losses:
        row.update(final_loss=losses[-1], mean_loss=statistics.fmean(losses))
    try:
        report = json.loads((job / REPORT).read_text()) if (job / REPORT).is_file() else None
    except ValueError:  # cut short by a crash: the job is listed, its report said to be unreadable
        report, row["status"], row["error"] = None, "report unreadable", f"{job / REPORT} is not valid JSON"
    heldout = []
    if report:
        progress = report.get("distillation_progress") or {}
        heldout = [(p["update"], p["value"]) for p in progress.get("exact_reverse_kl") or [] if p["value"] is not None]
        if heldout:
            row.update(heldout_kl=heldout[-1][1], heldout_kl_update=heldout[-1][0])
        m = report["measurements"]
        row.update(
            status=report["status"],
            peak_reserved_gib=m["peak_reserved_gib"],
            peak_rss_gib=m.get("peak_rss_gib"),
            resume=report["resume"]["status"],
            **m["steady_state_median_throughput"],
        )
        if report.get("failure"):
            row["error"] = report["failure"]["reason"]
    if (job / ERROR_FILE).is_file():  # a job a signal stopped keeps its report's status: interrupted
        row.update(status=row["status"] if row["status"] == "interrupted" else "failed")
        row.update(error=(job / ERROR_FILE).read_text().strip())
    if row["status"] is None:
        row["status"] = "running or crashed"
    return row, losses, heldout


def job_computes(overrides: list[str]) -> list[str]:
    """A job's overrides but those that say how it runs (RUN_CONTROL_KEYS), sorted."""
    return sorted(o for o in overrides if override_key(o) not in RUN_CONTROL_KEYS)


def not_run_row(number: int, overrides: list[str]) -> dict:
    """The row of a job the sweep's multirun.yaml plans and no job folder holds."""
    row = {column: None for column in COLUMNS}
    why = "no job folder: the sweep has not reached this job or stopped before it; the same sweep command runs it"
    return {**row, "job": str(number), "overrides": " ".join(overrides), "status": "not run", "error": why}


def planned_jobs(sweep_dir: Path) -> list[list[str]] | None:
    """Every job's overrides as the sweep's multirun.yaml numbers them; None where it cannot tell."""
    try:
        hydra_cfg = OmegaConf.load(sweep_dir / "multirun.yaml").hydra
    except Exception:  # none (a summary of job folders copied together), or not Hydra's
        return None
    return each_job(sweep_arguments(hydra_cfg))


def write_summary(sweep_dir: Path) -> list[dict]:
    # Imports torch: not at Hydra start-up.
    from miniverl.utils.run_folder import atomic_write_bytes

    folders = job_dirs(sweep_dir)
    overrides = [job_overrides(job) for job in folders]  # lists: a quoted value may hold a space
    jobs = [summarize_job(job, own) for job, own in zip(folders, overrides)]
    planned = planned_jobs(sweep_dir)
    # A planned job without a folder (a sweep stopped before it) is a row too: a gap in the table says so.
    # Matched on what the jobs compute: a kept job's folder has no trainer.overwrite the sweep run again has.
    computes = [job_computes(own) for own in overrides]
    for number, own in enumerate(planned or []):
        if (computed := job_computes(own)) in computes:
            computes.remove(computed)
        else:
            jobs.append((not_run_row(number, own), [], []))
            overrides.append(own)
    in_order = sorted(zip(jobs, overrides), key=lambda pair: job_order(pair[0][0]["job"]))
    jobs, overrides = [job for job, _ in in_order], [own for _, own in in_order]
    rows = [row for row, _, _ in jobs]
    # What tells the jobs apart: over every job of the sweep, those not run yet (a stopped sweep) included.
    every = planned or overrides
    common = set.intersection(*(set(job) for job in every)) if every else set()
    for row, own in zip(rows, overrides):
        row["swept"] = " ".join(o for o in own if o not in common) or "(none)"
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_bytes(sweep_dir / "sweep_summary.csv", text.getvalue().encode())
    shared = [o for o in (overrides[0] if overrides else []) if o in common]
    atomic_write_bytes(sweep_dir / "sweep_summary.md", markdown(rows, shared).encode())
    plot(jobs, sweep_dir / "sweep_summary.png")
    return rows


def cell(value) -> str:
    return format_value(value, null="", digits=4).replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[dict], common: list[str]) -> str:
    shown = [c for c in COLUMNS if c not in ("run_dir", "overrides")]
    lines = [
        f"Common overrides: `{' '.join(common) or '(none)'}`",
        "",
        "| " + " | ".join(shown) + " |",
        "|" + "---|" * len(shown),
    ]
    lines += ["| " + " | ".join(cell(row[c]) for c in shown) + " |" for row in rows]
    return "\n".join(lines) + "\n"


MARKERS = "osD^vP*X"


# Two curves closer than this share of the axis' span draw as one line (the plot is 450 px tall).
ONE_LINE_SHARE = 0.005


def legend_labels(jobs: list[tuple[dict, list[float]]]) -> list[str]:
    """One legend entry per drawn job; a job whose losses lie on an earlier job's line (within
    ONE_LINE_SHARE of the axis' span at every update) says so: the plot cannot show both."""
    values = [v for _, losses in jobs for v in losses]
    tolerance = ONE_LINE_SHARE * (max(values) - min(values)) if values else 0.0
    labels = []
    for index, (row, losses) in enumerate(jobs):
        label = f"#{row['job']} {row['swept']}"[:80] + ("" if row["status"] in DONE else f" ({row['status']})")
        under = next(
            (
                earlier["job"]
                for earlier, drawn in jobs[:index]
                if len(drawn) == len(losses) and all(abs(a - b) <= tolerance for a, b in zip(drawn, losses))
            ),
            None,
        )
        labels.append(label if under is None else f"{label} (on the line of #{under})")
    return labels


def plot(jobs: list[tuple[dict, list[float], list[tuple[int, float]]]], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = any(heldout for _, _, heldout in jobs)
    fig, axes = plt.subplots(1, 2 if measured else 1, figsize=(14 if measured else 8, 4.5), dpi=100, squeeze=False)
    ax, kl_ax = axes[0][0], axes[0][-1]
    drawn = [(row, losses, heldout) for row, losses, heldout in jobs if losses]
    labels = legend_labels([(row, losses) for row, losses, _ in drawn])
    for index, ((_, losses, heldout), label) in enumerate(zip(drawn, labels)):
        # Each job its own marker, and later ones drawn thinner, so that lines that meet stay visible.
        style = dict(
            marker=MARKERS[index % len(MARKERS)],
            markersize=max(7 - index, 3),
            fillstyle="none",
            linewidth=max(2.5 - 0.4 * index, 0.8),
        )
        line = ax.plot(range(1, len(losses) + 1), losses, label=label, **style)[0]
        if measured and heldout:
            kl_ax.plot([u for u, _ in heldout], [v for _, v in heldout], color=line.get_color(), **style)
    ax.set_ylabel(LOSS_KEY)
    ax.set_title(f"sweep: {path.parent.name} ({len(jobs)} jobs)")
    if measured:
        kl_ax.set_ylabel("val/distillation/exact_reverse_kl (nats per position)")
        kl_ax.set_title("held-out exact reverse KL")
    for axis in {ax, kl_ax}:
        axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        axis.set_xlabel("optimizer update")
        axis.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)
    fig.tight_layout()
    from miniverl.utils.run_folder import atomic_write  # imports torch: not at Hydra start-up

    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


EXPORT_JOB = "export"  # Hydra's job name of `python -m miniverl.export` (its module's name)


class SweepSummaryCallback(Callback):
    """Rewrites the summary after every job of a multirun (Hydra stops a sweep's bookkeeping when a
    job fails, so waiting for on_multirun_end would lose it)."""

    def on_job_end(self, config, job_return, **kwargs) -> None:
        from hydra.types import RunMode

        if config.hydra.mode == RunMode.MULTIRUN and config.hydra.job.name != EXPORT_JOB:
            write_summary(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config, **kwargs) -> None:
        if config.hydra.job.name == EXPORT_JOB:  # a swept export trains nothing: each job printed where it wrote
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_summary(sweep_dir)
        # A job stopped here by trainer.stop_after_updates, as asked (a signal stops the sweep before this).
        stopped = [row["job"] for row in rows if row["status"] == "interrupted"]
        failed = [row["job"] for row in rows if row["status"] not in (*DONE, "not run", "interrupted")]
        not_run = [row["job"] for row in rows if row["status"] == "not run"]  # a job folder removed meanwhile
        again = shell_override("hydra.sweep.dir", sweep_dir)
        later = (
            f", {len(stopped)} stopped at trainer.stop_after_updates (they go on with the sweep's command and {again})"
        )
        print(
            f"sweep: {len(rows) - len(failed) - len(not_run) - len(stopped)} of {len(rows)} jobs completed"
            f"{later if stopped else ''}; summary in {sweep_dir}/sweep_summary.md",
            flush=True,
        )
        if failed or not_run:
            what = [
                f"sweep job(s) {', '.join(jobs)} {how}"
                for jobs, how in ((failed, "failed"), (not_run, "did not run"))
                if jobs
            ]
            print(f"miniverl: error: {'; '.join(what)}; see {sweep_dir}/sweep_summary.md", file=sys.stderr)
            sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miniverl.sweep_summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dir", type=Path, help="a Hydra sweep folder (hydra.sweep.dir)")
    args = parser.parse_args(argv)
    fix = "give the sweep's hydra.sweep.dir (the folder of multirun.yaml and the numbered job folders)"
    if not args.sweep_dir.is_dir():
        what = "is a file, not a folder" if args.sweep_dir.exists() else f"no such folder (relative to {Path.cwd()})"
        return exit_code_of(MiniverlError(f"{args.sweep_dir}: {what}; {fix}"))
    if not job_dirs(args.sweep_dir):
        single = " (a single run's folder: its report.md is its summary)" if (args.sweep_dir / REPORT).exists() else ""
        what = f"{args.sweep_dir} holds no Hydra job folders (<n>/.hydra/overrides.yaml){single}; {fix}"
        return exit_code_of(MiniverlError(what))
    if not (args.sweep_dir / "multirun.yaml").is_file():  # outputs/<date>/ of single runs, /tmp: not a sweep's
        what = f"{args.sweep_dir} has no multirun.yaml, so it is no sweep's folder (nothing written there); {fix}"
        return exit_code_of(MiniverlError(what))
    write_summary(args.sweep_dir)
    print((args.sweep_dir / "sweep_summary.md").read_text(), end="")
    print(f"wrote {args.sweep_dir / 'sweep_summary.csv'}, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
