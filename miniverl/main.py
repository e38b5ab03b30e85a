"""`python -m miniverl.main +recipe=opd_k1 [overrides]`: distil a frozen teacher into a LoRA student on
its own samples, on one device (docs/usage.md); `-m` sweeps comma-separated overrides (Hydra multirun).
Before a long run `python -m miniverl.doctor` checks the same command; `python -m miniverl.export`
writes it as a verl launch."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from miniverl.trainer.runner import run, same_command
from miniverl.utils.errors import MiniverlError, RunStopped, ctrl_c_stop, exit_code_of
from miniverl.utils.hydra_entry import (
    as_typed,
    config_flags,
    log_line,
    one_line_hydra_errors,
    run_as_main,
    write_record,
)
from miniverl.utils.overrides import shell_override
from miniverl.utils.signals import interrupting_signals, signal_of
from miniverl.verl_compat.field_rules import verl_key_hints

log = logging.getLogger("miniverl")


@one_line_hydra_errors(verl_hints=verl_key_hints)
@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    args = [*config_flags(hydra_cfg), *as_typed(hydra_cfg.overrides.task)]
    sweep = hydra_cfg.mode == RunMode.MULTIRUN
    if sweep:  # an earlier attempt's (the same sweep again in its folder): this one writes its own
        from miniverl.utils.run_folder import ERROR_FILE

        (run_dir / ERROR_FILE).unlink(missing_ok=True)
    # A folder that holds an earlier run keeps that command's record (KeepEarlierRunRecord) until this run
    # replaces the run there (trainer.overwrite=true, or a restart of one killed before its first checkpoint).
    recorded = []

    def record():
        write_record(cfg, hydra_cfg, run_dir / ".hydra")
        recorded.append(True)

    kept_record = hydra_cfg.output_subdir is None
    try:
        try:
            with interrupting_signals():  # SIGTERM outside an update: one line, as Ctrl-C (by default: none)
                run(cfg, run_dir, args, sweep=sweep, record=record if kept_record else None)
        except KeyboardInterrupt as stop:  # before the run (imports, pre-flight checks) or after it (its resume check)
            by = signal_of(stop)
            raise ctrl_c_stop(f"stopped by {by.name}; run {same_command(args, sweep)} again to go on", by) from None
    except Exception as error:
        if sweep and os.environ.get("HYDRA_FULL_ERROR") != "1":
            # Record why this job failed; the sweep-summary callback lists it and makes the command
            # exit non-zero at the end. A failed job lets the sweep go on; a signal stops the sweep.
            from miniverl.sweep_summary import write_summary
            from miniverl.utils.run_folder import ERROR_FILE

            message = str(error) if isinstance(error, MiniverlError) else f"{type(error).__name__}: {error}"
            (run_dir / ERROR_FILE).write_text(message + "\n")
            if not isinstance(error, RunStopped):
                log.error("job failed: %s", message)
                return
            sweep_dir = Path(hydra_cfg.sweep.dir)
            try:
                write_summary(sweep_dir)  # Hydra calls no callback for a job that ends the command
            except Exception as unwritten:  # the stop's line matters more; the summary can be rebuilt
                log.warning("sweep summary not written (python -m miniverl.sweep_summary rebuilds it): %s", unwritten)
            error = RunStopped(
                f"{error}; the sweep stopped in job {hydra_cfg.job.num} (what ran: {sweep_dir / 'sweep_summary.md'}); "
                "to go on with every job, run the sweep's command again with "
                + shell_override("hydra.sweep.dir", sweep_dir)
                + (
                    " and without trainer.overwrite=true (it would start every job afresh)"
                    if cfg.trainer.overwrite
                    else ""
                ),
                error.exit_code - 128,
            )
        if not isinstance(error, MiniverlError):
            raise
        if hydra_cfg.output_subdir is not None or recorded:  # None: the folder is an earlier run's, left as it was
            log_line(log, str(error), logging.ERROR)
        sys.exit(exit_code_of(error))


def cli() -> None:
    """The console script: runs this module as `python -m miniverl.main` does."""
    run_as_main("miniverl.main")


if __name__ == "__main__":
    main()
