"""The report as people would rather read it: `report.md` (report.json as a page) and `curves.png`
(distillation loss — with several teachers, each teacher's beside it —, grad norm, response length
and, when measured, the task score, the held-out KL and the held-out task score over the updates),
beside report.json in every run folder."""

from __future__ import annotations

from pathlib import Path

from miniverl.trainer.console import centred_advantages, heldout_rows, teacher_losses
from miniverl.utils.run_folder import atomic_write
from miniverl.utils.run_names import LOSS_KEY, SCORE_KEY
from miniverl.utils.tables import flatten, format_value

# (metric, axis label) of the curves, in verl's metric names.
CURVES = (
    (LOSS_KEY, "distillation loss"),
    ("actor/grad_norm", "grad norm"),
    ("response_length/mean", "response length (tokens)"),
)
TASK_CURVE = (SCORE_KEY, "task score (mean)")  # with estimator.use_task_rewards
PANELS_PER_ROW = 3  # curves.png wraps into rows: six panels in one row were 2160 x 320 pixels
# Sections of report.json shown as tables, in this order; the rest follow.
SECTIONS = ("recipe", "measurements", "resume", "models", "hardware", "artifacts", "resource_contract")


def _cell(value) -> str:
    return format_value(value, null="—", digits=5).replace("|", "\\|").replace("\n", " ")


def markdown(report: dict, history: list[dict]) -> str:
    recipe = report["recipe"]
    lines = [
        f"# miniverl run: {report['profile']}",
        "",
        f"Status **{report['status']}** after {len(history)} of {recipe['optimizer_updates']} updates; "
        f"estimator `{recipe['estimator']}`; resume `{report['resume']['status']}`.",
    ]
    if history:
        centred = " (~0 by construction with estimator.advantage_baseline)" if centred_advantages(recipe) else ""
        lines.append(f"Final distillation loss ({LOSS_KEY}): **{history[-1][LOSS_KEY]:.5g}**{centred}.")
        if per_teacher := teacher_losses(history[-1]):
            lines.append(
                "Per teacher: " + ", ".join(f"{name} **{value:.5g}**" for name, value in per_teacher.items()) + "."
            )
        if TASK_CURVE[0] in history[-1]:
            lines.append(f"Task score ({TASK_CURVE[0]}) at the last update: **{history[-1][TASK_CURVE[0]]:.4g}**.")
    # What the student learned, as the console says it (a centred policy gradient's loss cannot say it).
    lines += [f"Held-out: {text}." for _, text in heldout_rows(report.get("distillation_progress"))]
    if report.get("failure"):
        lines.append(f"Failure: update {report['failure']['update']}: {report['failure']['reason']}")
    lines += ["", "![curves](curves.png)", ""]
    rest = [k for k, v in report.items() if isinstance(v, dict) and k not in SECTIONS]
    for section in (*SECTIONS, *rest):
        if not isinstance(report.get(section), dict):
            continue
        lines += [f"## {section}", "", "| field | value |", "|---|---|"]
        rows = flatten(report[section])
        lines += [f"| `{key}` | {_cell(value)} |" for key, value in rows.items()]
        lines.append("")
    top = {k: v for k, v in report.items() if not isinstance(v, dict)}
    lines += ["## identity", "", "| field | value |", "|---|---|"]
    lines += [f"| `{key}` | {_cell(value)} |" for key, value in top.items()]
    return "\n".join(lines) + "\n"


def plot_curves(report: dict, history: list[dict], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    progress = report.get("distillation_progress") or {}
    held_out = [(key, progress[key]) for key in ("k1_mean", "exact_reverse_kl") if progress.get(key)]
    curves = CURVES + ((TASK_CURVE,) if history and TASK_CURVE[0] in history[0] else ())
    held_out_score = progress.get("task_score") or []  # the student's own held-out samples, scored
    # A teacher of another tokenizer: its log-likelihood per character of the student's held-out text, on a
    # scale (and sign) of its own, beside the span k1.
    held_out_loglik = progress.get("teacher_loglik_per_char") or []
    panels = len(curves) + sum(1 for measured in (held_out, held_out_loglik, held_out_score) if measured)
    columns = min(panels, PANELS_PER_ROW)
    rows = -(-panels // columns)
    fig, grid = plt.subplots(rows, columns, figsize=(3.6 * columns, 3.2 * rows), dpi=100, squeeze=False)
    axes = list(grid.flat)
    for spare in axes[panels:]:  # the last row's empty cells
        spare.remove()
    axes = axes[:panels]
    updates = range(1, len(history) + 1)
    for ax, (key, label) in zip(axes, curves):
        ax.plot(updates, [m.get(key) for m in history], marker="o", markersize=3, label="all")
        ax.set_title(label, fontsize=10)
        names = list(dict.fromkeys(n for m in history for n in teacher_losses(m))) if key == LOSS_KEY else []
        for name in names:
            values = [teacher_losses(m).get(name, float("nan")) for m in history]  # nan: no sample that update
            ax.plot(updates, values, linewidth=1, label=name)
        if names:
            ax.legend(fontsize=7)
    if held_out_score:
        ax = axes[-1]
        ax.plot([p["update"] for p in held_out_score], [p["value"] for p in held_out_score], marker="o", markersize=3)
        ax.set_title("held-out task score (val/task_score)", fontsize=10)
    if held_out:
        ax = axes[len(curves)]
        for key, points in held_out:
            ax.plot([p["update"] for p in points], [p["value"] for p in points], marker="o", markersize=3, label=key)
        ax.set_title("held-out KL (val/distillation)", fontsize=10)
        ax.legend(fontsize=7)
    if held_out_loglik:
        ax = axes[len(curves) + (1 if held_out else 0)]
        ax.plot([p["update"] for p in held_out_loglik], [p["value"] for p in held_out_loglik], marker="o", markersize=3)
        ax.set_title("held-out teacher log-lik. per char", fontsize=10)
    for ax in axes:
        ax.set_xlabel("optimizer update")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.suptitle(f"{report['profile']}: {report['status']}", fontsize=10)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


def write_report_page(report: dict, history: list[dict], run_dir: Path) -> None:
    atomic_write(run_dir / "report.md", lambda tmp: tmp.write_text(markdown(report, history)))
    plot_curves(report, history, run_dir / "curves.png")
