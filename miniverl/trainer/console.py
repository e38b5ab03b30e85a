"""What a run says on the console: what will run, at once (before the heavy imports), and the
closing table, in words and units. Imports nothing heavy: main prints the start lines before torch
and transformers are loaded."""

from __future__ import annotations

from pathlib import Path

from miniverl.config import MiniverlConfig
from miniverl.utils.overrides import override_key
from miniverl.utils.run_names import LOSS_KEY, SCORE_KEY

# The distillation loss the closing table and the progress bar show (verl's metric name).


def teacher_losses(metrics: dict) -> dict[str, float]:
    """Several teachers: each teacher's distillation loss of an update (`LOSS_KEY/<name>`), by name."""
    prefix = LOSS_KEY + "/"
    return {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix)}


def _model_line(block) -> str:
    quantization = "NF4" if block.quantization == "nf4" else block.dtype
    name = f"toy, {block.toy.tokenizer} tokenizer" if block.model_id == "toy" else block.model_id
    return f"{name} ({quantization})"


def _teacher_line(block, where: str) -> str:
    if block.mode == "ref":  # the student's own base: see models/adapters.py
        line = f"the student's base ({where}.mode=ref)"
    elif block.mode == "shared_base":  # its adapter on the student's base, one copy of the base
        line = f"the student's base + the adapter {block.adapter} ({where}.mode=shared_base)"
    else:
        line = _model_line(block) + (f" + the adapter {block.adapter}" if block.adapter else "")
    if block.context.enabled:  # what it reads is not the student's prompt
        line += f", with a privileged context ({where}.context)"
    if block.text_aligned:  # what it scores is text, in its own tokens (its tokenizers are not loaded yet here)
        line += f", scoring the text in its own tokens if not the student's ({where}.tokenizer_alignment=text)"
    return line


def teacher_rows(cfg: MiniverlConfig) -> list[tuple[str, str]]:
    """One row for one teacher; one per teacher, with the key it scores, for several."""
    if not cfg.routed:  # `teacher`, or a `teachers` block of one (it scores every row)
        ((name, block),) = cfg.teacher_blocks.items()
        return [("teacher", _teacher_line(block, cfg.teacher_where(name)))]
    rows = [
        (f"teacher {name}", f"{_teacher_line(block, cfg.teacher_where(name))} for {cfg.teacher_key}={block.key}")
        for name, block in cfg.teachers.items()
    ]
    if cfg.default_teacher is not None:
        rows.append(("routing", f"a row of another {cfg.teacher_key} goes to {cfg.default_teacher}"))
    return rows


def start_lines(
    cfg: MiniverlConfig, run_dir: Path, *, sweep: bool = False, pending_check: bool = False, overrides: list[str] = ()
) -> str:
    """The run folder and what will run: the models, the updates, the loss and the device (and
    whether the resume check runs: not in a sweep job unless asked; alone for a finished run
    whose check was stopped)."""
    recipe, est, lora = cfg.recipe, cfg.estimator, cfg.model.lora
    student = f"{_model_line(cfg.model)} + LoRA r={lora.r} on {lora.describe_targets()}"
    if cfg.model.adapter:
        student = f"{_model_line(cfg.model)} + the adapter {cfg.model.adapter}"
    update = "policy gradient" if est.use_policy_gradient else "direct"
    device = "CUDA if present, else the CPU" if cfg.hardware.device == "auto" else cfg.hardware.device
    # main runs the check after a whole fresh run only: not when stopped early, nor when resuming
    # (from trainer.resume_from, or from this folder's own checkpoints with resume_mode=auto).
    resuming = bool(cfg.trainer.resume_from) or (
        cfg.trainer.resume_mode != "disable" and not cfg.trainer.overwrite and any(run_dir.glob("checkpoints/update_*"))
    )
    checked = recipe.resume_check_after is not None and cfg.trainer.stop_after_updates is None and not resuming
    runs_here = recipe.resume_check_in(sweep) is not None
    resume = f"resume check after update {recipe.resume_check_after}" if checked and runs_here else "no resume check"
    if checked and not runs_here:
        resume += " (a sweep job: recipe.resume_check_in_sweeps=true runs it)"
    elif recipe.resume_check_after is not None and not checked:  # say why the recipe's check does not run
        why = "a resumed run" if resuming else "trainer.stop_after_updates is set"
        resume += f" ({why}; it runs after a whole fresh run)"
    if pending_check:
        resume = f"the finished run here: only its resume check (after update {recipe.resume_check_after}) runs"
    rows = [
        ("student", student),
        *teacher_rows(cfg),
        (
            "plan",
            f"{counted(recipe.optimizer_updates, 'update')} x {counted(recipe.logical_batch, 'prompt')}"
            + (f" x {cfg.rollout.n} samples" if cfg.rollout.n > 1 else "")
            + f", responses up to {recipe.response_limit} tokens; estimator {est.loss_mode} ({update}, "
            f"{est.loss_agg_mode})",
        ),
        ("device", f"{device} (hardware={cfg.hardware.name}); {resume}"),
    ]
    if est.use_task_rewards:
        scorer = cfg.reward.custom_reward_function
        rule = f"{scorer.name} from {scorer.path}" if scorer.path else "the rule of each row's data_source"
        rows.append(
            (
                "reward",
                f"task rewards ({rule}), {cfg.algorithm.adv_estimator} advantages, + "
                f"{est.distillation_loss_coef:g} x the distillation loss",
            )
        )
    rows += [("note", note) for note in unread_settings(cfg, overrides)]  # set, and not read: before the run
    # Where the check runs elsewhere than set, or not at all for want of updates (a sweep job without it: nothing).
    if recipe.resume_check_note and (recipe.resume_check_after is None or (checked and runs_here)):
        rows.append(("note", recipe.resume_check_note))
    return f"miniverl: run folder {run_dir}\n" + _table(rows)


# Keys that only task rewards read (algorithm.bypass_mode and rollout_correction reach distillation too).
TASK_REWARD_KEYS = ("reward.", "algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo")


def unread_settings(cfg: MiniverlConfig, overrides: list[str]) -> list[str]:
    """What the command sets that this run does not read, one note per reason: the single `teacher` block
    beside `teachers`, the task reward's settings without task rewards (the recipe's reward function
    file too, set or not on the command line), the top-k keys with a loss that takes no top-k."""
    keys = {override_key(o) for o in overrides if "=" in o and not o.startswith("--")}
    notes = []
    if cfg.teachers and (single := sorted(k for k in keys if k == "teacher" or k.startswith("teacher."))):
        names = ", ".join(f"teachers.{name}" for name in cfg.teachers)
        notes.append(f"{', '.join(single)} {'is' if len(single) == 1 else 'are'} not read: {names} score the rows")
    if not cfg.estimator.use_task_rewards:
        rewards = {k for k in keys if k.startswith(TASK_REWARD_KEYS)}
        rewards |= {"reward.custom_reward_function.path"} if cfg.reward.custom_reward_function.path else set()
        if rewards:
            verb = "is" if len(rewards) == 1 else "are"
            notes.append(f"{', '.join(sorted(rewards))} {verb} not read: estimator.use_task_rewards=false")
    est = cfg.estimator  # verl reads its top-k keys with a top-k loss only, and says nothing either
    topk = {"estimator.topk"} if not est.topk_loss else set()
    topk |= set() if est.uses_topk else {"estimator.use_chunked_topk", "estimator.chunked_topk_chunk_size"}
    if topk := sorted(keys & topk):
        verb = "is" if len(topk) == 1 else "are"
        notes.append(f"{', '.join(topk)} {verb} not read: estimator.loss_mode={est.loss_mode} takes no teacher top-k")
    return notes


def counted(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _seconds_and_rate(seconds: float | None, rate: float | None, unit: str) -> str:
    if seconds is None:
        return "not measured"
    if rate is None:
        return f"{seconds:.3g} s/update"
    return (
        f"{seconds:.3g} s/update, {rate:,.1f} {unit}/s"
        if rate < 100
        else f"{seconds:.3g} s/update, {rate:,.0f} {unit}/s"
    )


# The held-out measure the closing table shows, the first one a run has (a teacher of another
# tokenizer has no exact KL): what says whether the student came closer to its teacher.
HELDOUT_MEASURES = {
    "exact_reverse_kl": "exact reverse KL, nats per position",
    "k1_mean": "k1 mean, nats per token",
    "teacher_loglik_per_char": "the teacher's log-likelihood per character",
}


def heldout_rows(progress: dict | None) -> list[tuple[str, str]]:
    """("held-out", first -> last) of the run's held-out KL curve (the exact one, else the k1 mean) and of the
    teacher's log-likelihood per character where a teacher of another tokenizer measured it, when the probe ran."""
    rows = []
    for key, what in HELDOUT_MEASURES.items():
        points = (progress or {}).get(key) or []
        if key == "k1_mean" and rows:  # the exact KL said it
            continue
        if len(points) > 1 and points[0]["value"] is not None and points[-1]["value"] is not None:
            first, last = points[0], points[-1]
            rows.append(
                (
                    "held-out",
                    f"{first['value']:.4g} at update {first['update']} -> {last['value']:.4g} at update "
                    f"{last['update']} ({what})",
                )
            )
    return rows


def centred_advantages(recipe: dict) -> bool:
    """Whether a policy gradient's loss is ~0 whatever the student learned: at ratio 1 it is minus the
    mean advantage, which the batch-mean baseline makes zero where the loss averages what the baseline
    averaged (every response token, summed or token-averaged) and nothing else enters the advantage (a
    discount sums future estimates after the baseline; a task reward adds its own advantage)."""
    selection = recipe.get("token_selection") or {}
    return (
        recipe.get("advantage_baseline", "none") != "none"
        and not recipe.get("kl_discount_factor")
        and selection.get("by", "none") == "none"
        and recipe.get("loss_agg_mode", "token-mean") != "seq-mean-token-mean"
        and not recipe.get("task_rewards")
    )


def closing_lines(report: dict, history: list[dict], run_dir: Path) -> str:
    """The closing table: status, final loss, phases, memory, downshifts, resume and where it all is."""
    m, resume = report["measurements"], report["resume"]
    seconds, rates = m["steady_state_median_seconds"], m["steady_state_median_throughput"]
    planned = report["recipe"]["optimizer_updates"]
    # A log-ratio of probabilities (nats), squared for mse/k2; with policy gradient the surrogate of it.
    unit = "nats^2" if report["recipe"]["estimator"] in ("mse", "k2") else "nats"
    loss = f"{history[-1][LOSS_KEY]:.4g} {unit} ({LOSS_KEY} at update {len(history)})" if history else "no update ran"
    if history and centred_advantages(report["recipe"]):
        progress = report.get("distillation_progress") or {}
        probed = sorted({p["update"] for key in HELDOUT_MEASURES for p in progress.get(key) or []})
        if heldout_rows(progress):  # the exact KL, else the k1 mean and loglik
            said = "the held-out rows below say what the student learned"
        elif probed:  # a run stopped before its second probe
            said = f"the held-out probe has measured update {probed[0]} only so far (a resumed run goes on with it)"
        else:
            said = "set eval.every to measure what the student learned on held-out prompts"
        loss += "; ~0 by construction with estimator.advantage_baseline: " + said
    if m["peak_reserved_gib"] is not None:
        memory = f"{m['peak_reserved_gib']:.2f} GiB reserved, {m['peak_allocated_gib']:.2f} GiB allocated (CUDA)"
    else:
        memory = f"{m['peak_rss_gib']:.2f} GiB resident (the process, CPU)"
    shifts = {k: v for k, v in m["batch_downshifts"].items() if v}
    checked = resume.get("status") in ("exact_match", "mismatch")
    resume_text = {
        "exact_match": "exact_match: stopped, resumed in a fresh process, byte-identical",
        "not_checked": "not checked",
        "resumed": f"resumed from {resume.get('resumed_from')}",
    }.get(resume["status"], resume["status"])
    if checked and resume.get("resumed_after_update"):
        resume_text += f" (interrupted after update {resume['resumed_after_update']})"
    if resume.get("inexact_because"):  # trainer.resume_inexact let a process that computes otherwise go on
        resume_text += f", inexact ({'; '.join(resume['inexact_because'])})"
    rows = [
        ("status", f"{report['status']} ({len(history)} of {planned} updates)"),
        ("final loss", loss),
        *heldout_rows(report.get("distillation_progress")),
        *[  # several teachers: each one's
            (f"  {name}", f"{value:.4g} {unit} ({LOSS_KEY}/{name})")
            for name, value in teacher_losses(history[-1] if history else {}).items()
        ],
        *(
            [("task score", f"{history[-1][SCORE_KEY]:.4g} ({SCORE_KEY} at update {len(history)})")]
            if history and SCORE_KEY in history[-1]
            else []
        ),
        ("rollout", _seconds_and_rate(seconds.get("rollout"), rates.get("rollout_tokens_per_second"), "tokens")),
        (
            "teacher scoring",
            _seconds_and_rate(
                seconds.get("teacher_scoring"), rates.get("teacher_scored_positions_per_second"), "positions"
            ),
        ),
        (
            "actor update",
            _seconds_and_rate(seconds.get("actor_update"), rates.get("update_positions_per_second"), "positions"),
        ),
        ("peak memory", memory),
        ("downshifts", ", ".join(f"{k.replace('_oom', '')} {v}" for k, v in shifts.items()) or "none"),
        ("resume", resume_text),
        ("run folder", str(run_dir)),
        ("read", "report.md (the report as a page), curves.png (the curves over the updates), report.json"),
        ("adapter", f"{run_dir / 'peft_adapter'} (a standard PEFT adapter)"),
    ]
    return _table(rows)
