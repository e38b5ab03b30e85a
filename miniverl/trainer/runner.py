"""One run as `python -m miniverl.main` runs it, from the composed config to the report: validate,
pre-flight checks, set up, train, finish, the recipe's own resume check; and the one line a stopped,
failed or refused run ends with (what stands, what resumes it). `main` (the command) adds Hydra and
the sweep's bookkeeping around it."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig
from safetensors import SafetensorError

from miniverl.config import to_config
from miniverl.trainer.console import closing_lines, start_lines
from miniverl.trainer.resume_state import (
    INTERRUPTED,
    PENDING,
    TWIN_ENV,
    check_command,
    check_is_pending,
    command_line,
    finished_here,
    pending_block,
)
from miniverl.utils.errors import WRITE_ERRNOS, MiniverlError, RunStopped, ctrl_c_stop
from miniverl.utils.hydra_entry import log_line
from miniverl.utils.identity import resolved_config
from miniverl.utils.overrides import shell_override
from miniverl.utils.signals import signal_of

log = logging.getLogger("miniverl")


def run(
    cfg: DictConfig, run_dir: Path, args: list[str] = (), sweep: bool = False, record: Callable[[], None] | None = None
) -> dict:
    """Validate, check, train and report; returns the report. `args` (the command line's config
    flags and overrides) let the recipe's resume check run this same job again in fresh processes; in a sweep job
    (`sweep`) the check runs only with recipe.resume_check_in_sweeps=true. `record`: writes this command's record,
    called once this run has replaced an earlier one in the folder (whose command's record is kept until then)."""
    config = to_config(cfg)
    k = None if os.environ.get(TWIN_ENV) else config.recipe.resume_check_in(sweep)
    resolved = resolved_config(cfg)
    pending = k is not None and check_is_pending(run_dir, resolved)
    kept = sweep and not pending and not config.trainer.overwrite and finished_here(run_dir, resolved)
    if kept:  # the same sweep run again in its folder: this job finished there before
        if kept["resume"]["status"] == "mismatch":
            return resume_verdict(kept, run_dir)  # raises: its check found a difference, as the first time
        log.info("job folder %s holds this job's run, finished: kept (another hydra.sweep.dir runs it again)", run_dir)
        return kept
    starting = start_lines(config, run_dir, sweep=sweep, pending_check=pending, overrides=list(args))
    print(starting, flush=True)  # at once: imports take seconds
    if pending:  # this very run, finished; a Ctrl-C stopped its resume check
        return finish_pending_check(run_dir, list(args), k)
    # Heavy imports (torch, transformers) after validation.
    from miniverl.trainer.opd_trainer import OPDTrainer

    warnings = preflight(config)
    refuse_overwriting_inputs(config, run_dir)
    trainer = OPDTrainer(config, resolved, run_dir)
    try:
        return train_and_report(trainer, run_dir, list(args), sweep, k, starting, warnings, record)
    finally:  # the run folder's lock: this process's run is over, however it ended
        if trainer.out is not None:
            trainer.out.release()


def train_and_report(
    trainer,
    run_dir: Path,
    args: list[str],
    sweep: bool,
    k: int | None,
    starting: str,
    warnings: list[str],
    record: Callable[[], None] | None,
) -> dict:
    """Set up, train, finish and check the resume of `trainer`'s run; the line a stopped or failed one ends with."""
    config = trainer.cfg
    try:
        try:
            setup_or_discard(trainer)
        finally:  # main.log gets them once the folder is this run's (trainer.out), a setup failing there too;
            if trainer.out is not None:  # a refused command leaves an earlier run's log as it was
                to_main_log(starting)
                for line in warnings:
                    log_line(log, line, logging.WARNING)
                if record is not None and trainer.out.fresh:  # this run replaced the folder's (not a resume)
                    record()
        stop, resumed = config.trainer.stop_after_updates, trainer.resumed
        if stop is not None and resumed is not None and stop < resumed.update:  # equal: the stop's own command
            log.warning(
                "trainer.stop_after_updates=%d is before update %d, where this run resumes: no stop",
                stop,
                resumed.update,
            )
        status = trainer.train()
        # A whole fresh run checks its own resume (not one stopped early, nor a resumed one); one a
        # signal stopped in its last update leaves the check to the same command, run again.
        checking = k is not None and status == "measured" and trainer.resumed is None
        checking = checking and config.trainer.stop_after_updates is None
        unchecked = pending_block(INTERRUPTED if trainer.stopped_by else PENDING)  # until the check's verdict
        report = trainer.finish(status, resume_check=unchecked if checking else None)
    except (OSError, SafetensorError) as error:
        code = write_error_code(error)
        if code is None:
            raise
        where = getattr(error, "filename", None) or run_dir
        last = f"; the last complete checkpoint is {trainer.last_checkpoint}" if trainer.last_checkpoint else ""
        resume = resume_override(run_dir) if trainer.last_checkpoint else same_command(args, sweep)
        raise MiniverlError(
            f"cannot write {where}: {os.strerror(code)}{last}; free space or choose another hydra.run.dir, "
            f"then run again with {resume}"
        ) from None
    except KeyboardInterrupt as stop:  # no update in flight to finish (loading, a probe, the report), or a 2nd signal
        by = signal_of(stop)
        raise ctrl_c_stop(interrupted_line(trainer, same_command(args, sweep), by.name), by) from None
    if trainer.stopped_by:
        by = signal.Signals(trainer.stopped_by).name
        check = check_command(list(args), run_dir) if checking else None
        raise RunStopped(stopped_line(trainer, run_dir, by, check, same_command(args, sweep)), trainer.stopped_by)
    if status == "failed":
        # A reward function's file is part of the plan: a resume takes it only as it was.
        unchanged = " with the function's file unchanged" if getattr(trainer.failure_cause, "file", None) else ""
        kept = (
            f"the last complete update is checkpointed (resume with {resume_override(run_dir)}{unchanged})"
            if trainer.last_checkpoint
            else "no update completed, so there is nothing to resume: run again once it is fixed"
        )
        raise MiniverlError(
            f"update {trainer.failure['update']} failed: {trainer.failure['reason']}; {kept}; report: "
            f"{run_dir / 'report.json'}"
        ) from trainer.failure_cause
    if checking:
        try:
            report = check_own_resume(trainer, run_dir, list(args), k)
        except KeyboardInterrupt as stop:  # before the check's children start (they run under its own handler)
            by, rerun = signal_of(stop), check_command(list(args), run_dir)
            line = f"stopped by {by.name} before the resume check; the run itself is finished and kept; to check it: "
            line += rerun
            raise ctrl_c_stop(line, by) from None
    show(closing_lines(report, trainer.history, run_dir))
    if status == "interrupted":  # trainer.stop_after_updates, as a preemption would: exit 0
        line = stopped_line(trainer, run_dir, "trainer.stop_after_updates", command=same_command(args, sweep))
        print(f"miniverl: {line}", flush=True)
        log_line(log, line)
    return report


def setup_or_discard(trainer) -> None:
    """trainer.setup() and the start of trainer.logger's trackers (a W&B run); one that fails once the
    folder is this fresh run's (a model that does not load, no W&B account) takes back what it wrote
    there: its plan.json would make the corrected command refuse the folder as a run's, with nothing in
    it to resume."""
    try:
        trainer.setup()
        trainer.tracking.start(trainer.resolved, continuing=not trainer.out.fresh)
    except BaseException:
        if trainer.out is not None:
            trainer.out.take_back()
        raise


def show(text: str) -> None:
    """Lines for the user (the closing table): on the console as printed, and in main.log."""
    print(text, flush=True)
    to_main_log(text)


def to_main_log(text: str) -> None:
    for line in text.splitlines():
        log_line(log, line)


def write_error_code(error: Exception) -> int | None:
    """The errno of a failed write that the user can fix (a full disk, a read-only folder), else
    None. safetensors' writer reports it as text: "I/O error: No space left on device (os error 28)"."""
    if isinstance(error, OSError):
        return error.errno if error.errno in WRITE_ERRNOS else None
    return next((code for code in WRITE_ERRNOS if f"(os error {code})" in str(error)), None)


def resume_override(path: Path) -> str:
    return shell_override("trainer.resume_from", path)


def same_command(args: list[str], sweep: bool) -> str:
    """What runs this run again: in a sweep, its job alone (the sweep's command runs every job), with the
    thread count its launcher set (joblib's workers run cores / n_jobs threads; a resume under another
    count is refused, utils/numerics.py)."""
    if not sweep:
        return "the same command"
    import torch

    threads = f"OMP_NUM_THREADS={torch.get_num_threads()} " if "OMP_NUM_THREADS" in os.environ else ""
    return threads + command_line(args)


def stopped_line(trainer, run_dir: Path, by: str, check: str | None = None, command: str = "the same command") -> str:
    """How a stopped run ends, by a signal or by trainer.stop_after_updates: where it stands and
    the command that resumes it (the same one: a resumed run is past any stop_after_updates); a
    run a signal stopped in its last update is finished, and `check` runs its resume check alone."""
    n = len(trainer.history)
    if n == len(trainer.plan.updates):
        done = f"stopped by {by} in the last update ({n} of {n}): the run is finished and kept (report.json, "
        done += "peft_adapter/)"
        later = f"; its resume check did not run: to run it alone, run the same command in that folder: {check}"
        return done + (later if check else "")
    return (
        f"stopped by {by} after update {n}, nothing left half-done; the last complete "
        f"checkpoint is {trainer.last_checkpoint}; resume with {command} and {resume_override(run_dir)}"
    )


def interrupted_line(trainer, command: str, by: str) -> str:
    """How a Ctrl-C or SIGTERM (`by`) ends a run with no update in flight to finish (loading, a
    held-out probe, the report), or a second one during an update: every file is written atomically,
    so the last checkpoint is whole (it can be another run's: the one this run resumes)."""
    from miniverl.utils.checkpoint import checkpoint_update

    last = trainer.last_checkpoint or (trainer.resumed.path if trainer.resumed is not None else None)
    if last is None:
        return f"stopped by {by} before any update was checkpointed; nothing to resume: run {command} again"
    if trainer.plan is not None and checkpoint_update(last) == len(trainer.plan.updates):
        return (
            f"stopped by {by} after the last update, before the run's report was complete; the trained run is "
            f"checkpointed in {last} (adapter.safetensors); run {command} again to write the report"
        )
    return f"stopped by {by}; the last complete checkpoint is {last}; resume with {command} and {resume_override(last)}"


def preflight(config) -> list[str]:
    """The doctor's cheap checks (data, tokenizers, memory) before any model is loaded; returns their
    warnings, shown on the console now and written to main.log once the folder is this run's."""
    from miniverl.trainer.preflight import cheap_checks
    from miniverl.utils.device import resolve_device

    checks = cheap_checks(config, resolve_device(config.hardware))
    warnings = [f"pre-flight {check}" for check in checks if check.status == "WARN"]  # a FAIL: the error line below
    for line in warnings:
        log_line(log, line, logging.WARNING, console=True, main_log=False)
    reasons: dict[str, list[str]] = {}  # a model that cannot be read fails several checks alike
    for check in checks:
        if check.status == "FAIL":
            reasons.setdefault(check.reason, []).append(check.name)
    failed = [f"{', '.join(names)}: {reason}" for reason, names in reasons.items()]
    if failed:
        raise MiniverlError("pre-flight check failed (python -m miniverl.doctor shows all): " + "; ".join(failed))
    return warnings


def refuse_overwriting_inputs(config, run_dir: Path) -> None:
    """trainer.overwrite=true empties the folder's run outputs before the models load: an input among them
    (an earlier run's peft_adapter/ as model.adapter, its toy_models/) would be gone, with the run's work."""
    from miniverl.trainer.plan import local_inputs
    from miniverl.utils.run_folder import outputs_holding

    if config.trainer.overwrite and (inside := outputs_holding(run_dir, local_inputs(config))):
        key, path = inside[0]
        raise MiniverlError(
            f"trainer.overwrite=true would remove {path} from {run_dir} before the run reads it ({key}): "
            "copy it out of that folder first, or choose another hydra.run.dir"
        )


def check_own_resume(trainer, run_dir: Path, args: list[str], k: int) -> dict:
    """recipe.interrupt_after_updates: rerun stopped after k and resumed, in fresh processes."""
    from miniverl.trainer.resume_check import finish_resume_check

    # The children load the same models: this process's copies (on CUDA, device memory) would
    # only crowd them. The adapter is saved already; the report is rebuilt without the models.
    trainer.release_models()
    report = finish_resume_check(run_dir, args, k, lambda block: trainer.finish("measured", resume_check=block))
    return resume_verdict(report, run_dir)


def finish_pending_check(run_dir: Path, args: list[str], k: int) -> dict:
    """The resume check of a finished run whose check a signal stopped; nothing is trained."""
    from miniverl.trainer.resume_check import finish_resume_check, finished_history, report_with_check

    log.info("%s holds this run, finished; its resume check did not finish: running the check only", run_dir)
    report = finish_resume_check(run_dir, args, k, lambda block: report_with_check(run_dir, block))
    report = resume_verdict(report, run_dir)
    show(closing_lines(report, finished_history(run_dir), run_dir))
    return report


def resume_verdict(report: dict, run_dir: Path) -> dict:
    if report["resume"]["status"] != "exact_match":
        raise MiniverlError(
            f"resume check failed: {report['resume']['first_difference']} (see {run_dir / 'report.json'})"
        )
    log.info("resume check: exact_match (adapter, optimizer, trajectories, training state)")
    return report
