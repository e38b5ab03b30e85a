"""What a run folder says about its resume check, read without loading torch (main asks before
its start lines): the report's status before a verdict, and whether this very run's check is
still to do."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

from miniverl.utils.run_names import REPORT, RESOLVED_CONFIG

PENDING, INTERRUPTED = "pending", "interrupted"  # the report's resume status before a verdict
SOUND = ("exact_match", "not_checked", "resumed")  # a finished run's resume status that needs nothing more
# Set in the environment of the check's two runs (resume_check.run_child): a twin never checks its
# own resume, so a twin that started afresh by mistake cannot start twins of its own without end.
TWIN_ENV = "MINIVERL_RESUME_CHECK_TWIN"


def command_line(args: list[str]) -> str:
    """`python -m miniverl.main` with these arguments (config flags, overrides), quoted for a shell."""
    return shlex.join(["python", "-m", "miniverl.main", *args])


def check_command(args: list[str], run_dir: Path) -> str:
    """The command that, run again, finishes a finished run's resume check and nothing else."""
    return command_line([*args, f"hydra.run.dir={run_dir}"])


def pending_block(status: str = PENDING) -> dict:
    """The report's `resume` block while the check has not given its verdict."""
    return {"status": status, "first_difference": None}


def check_is_pending(run_dir: Path, resolved: dict) -> bool:
    """`run_dir` holds this very run (the same resolved config), finished, with its resume check
    not done: stopped by a signal (`interrupted`) or its process killed (`pending`)."""
    report = finished_run_of(run_dir, resolved)
    return report is not None and report.get("resume", {}).get("status") in (PENDING, INTERRUPTED)


def finished_here(run_dir: Path, resolved: dict) -> dict | None:
    """The report of this very run (the same resolved config), finished with its resume check given
    its verdict (SOUND, or a mismatch) or not asked for, if `run_dir` holds one; else None."""
    report = finished_run_of(run_dir, resolved)
    done = report is not None and report.get("resume", {}).get("status") in (*SOUND, "mismatch")
    return report if done else None


def finished_run_of(run_dir: Path, resolved: dict) -> dict | None:
    """The report of a run in `run_dir` that finished (`measured`) and computed what `resolved` does."""
    try:
        report = json.loads((run_dir / REPORT).read_text())
        earlier = yaml.safe_load((run_dir / RESOLVED_CONFIG).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    same = isinstance(earlier, dict) and what_it_computes(earlier) == what_it_computes(resolved)
    return report if same and report.get("status") == "measured" else None


def what_it_computes(resolved: dict) -> dict:
    """A resolved config without RUN_CONTROL_KEYS: a sweep run once with trainer.overwrite=true is
    the same sweep again without it."""
    from miniverl.utils.sweeps import RUN_CONTROL_KEYS

    control = {key.split(".", 1)[1] for key in RUN_CONTROL_KEYS}  # all under trainer.
    trainer = {k: v for k, v in resolved.get("trainer", {}).items() if k not in control}
    return {**resolved, "trainer": trainer}
