"""The recipe's own exact-resume check (`recipe.interrupt_after_updates: k`).

After the uninterrupted run (the reference) finishes, the same command runs twice more in fresh
processes: once stopped after update k (`trainer.stop_after_updates=k`), once resumed from that
stop (`trainer.resume_from=...`). The interrupted run must have stopped at update k, the resumed
run's report must show it resumed from that checkpoint (a run that started afresh ends byte-equal
too, proving nothing), and its final checkpoint and trajectory log must equal the reference's
byte for byte; the result fills the report's `resume` block. The twins leave out the held-out
probe (`eval.every=-1`): it changes no training state (the plan leaves `eval` out, and it halves
its rows on out-of-memory in its own downshift, not training's), and it is a third of the twins'
time on the real recipe; their training histories are compared without its `val/` metrics.

The children run in their own session: a Ctrl-C at the terminal reaches this process only, which
kills them and says so (`finish_resume_check`). Until the verdict is in, the report's status is
`pending` (`interrupted` after a Ctrl-C); the same command run again in that folder runs only the
check (`resume_state.check_is_pending`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path

from miniverl.trainer.resume_state import INTERRUPTED, TWIN_ENV, check_command, pending_block
from miniverl.utils.checkpoint import checkpoint_update, checkpoints_in
from miniverl.utils.errors import MiniverlError, RunStopped
from miniverl.utils.measure import folder_bytes
from miniverl.utils.run_folder import atomic_write_bytes, flock_folder, readable_json
from miniverl.utils.run_names import MACHINE_METRIC_PREFIXES, REPORT, STATE, TRAJECTORIES
from miniverl.utils.signals import SignalReceived, die_with_parent, raised_signals

log = logging.getLogger(__name__)
# Differs between the three runs by construction (their trainer.stop_after_updates/resume_from).
EXCLUDED_RUN_IDENTITY_FIELD = "resolved_config_digest"
TRAINING_STATE_FIELDS = (
    "global_optimizer_steps",
    "task_cursor",
    "compiled_plan_sha256",
    "run_seed",
    "random_streams",
    "trajectory_digests",
    "trajectory_sha256",
    "downshift",
    "files",
    "finished",
)
UPDATE_LINE = re.compile(r"update (\d+)/(\d+) ")  # a child's console line per update (progress_bar=false)
HELD_OUT_PREFIX = "val/"  # the probe's metrics, which the twins do not measure


def run_child(args: list[str], extra: list[str], run_dir: Path) -> None:
    """One child run, its updates echoed as progress lines; killed (its whole process group) if
    this process is stopped while it runs."""
    label = "resumed run" if any(e.startswith("trainer.resume_from=") for e in extra) else "interrupted run"
    command = [
        sys.executable,
        "-m",
        "miniverl.main",
        *args,
        *extra,
        "eval.every=-1",  # the held-out probe measures, it does not train: the reference has its figures
        "trainer.progress_bar=false",
        f"hydra.run.dir={run_dir}",
    ]
    tail: deque[str] = deque(maxlen=20)
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one pipe: two could fill and block each other
        text=True,
        env={**os.environ, TWIN_ENV: "1", "WANDB_MODE": "disabled"},  # no resume check of its own; no W&B run
        start_new_session=True,  # not in the terminal's process group: a Ctrl-C is this process's to handle
        preexec_fn=functools.partial(die_with_parent, os.getpid()),  # a leftover would write into a later check
    )
    try:
        for line in child.stdout:
            tail.append(line.rstrip())
            found = UPDATE_LINE.search(line)
            if found:
                log.info("resume check: %s, update %s/%s", label, *found.groups())
        returncode = child.wait()
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)  # it and anything it started; its folder is scratch
            child.wait()
        child.stdout.close()
    if returncode != 0:
        errors = [line for line in tail if line.startswith("miniverl: error:")]
        last = (errors or [line for line in tail if line.strip()] or ["(no output)"])[-1]
        raise RuntimeError(f"{' '.join(extra)} exited {returncode}: {last}")


def training_history(history: list[dict]) -> list[dict]:
    """Each update's metrics without its timings and held-out figures: what training computed."""
    left_out = (*MACHINE_METRIC_PREFIXES, HELD_OUT_PREFIX)
    return [{k: v for k, v in m.items() if not k.startswith(left_out)} for m in history]


def first_difference(reference: Path, resumed: Path) -> tuple[dict, str | None]:
    """Compare two finished run folders; returns the three verdicts and the first difference."""
    ref_ckpt, res_ckpt = checkpoints_in(reference)[-1], checkpoints_in(resumed)[-1]
    differences = []
    tensors_same = True
    for name in ("adapter.safetensors", "optimizer.safetensors"):
        if (ref_ckpt / name).read_bytes() != (res_ckpt / name).read_bytes():
            tensors_same = False
            differences.append(f"{name} of {res_ckpt.name} differs from the reference's {ref_ckpt.name}")
    ref_traj = sorted((reference / TRAJECTORIES).glob("*.safetensors"))
    res_traj = sorted((resumed / TRAJECTORIES).glob("*.safetensors"))
    trajectories_same = [p.name for p in ref_traj] == [p.name for p in res_traj]
    if not trajectories_same:
        differences.append("the trajectory logs hold different updates")
    for a, b in zip(ref_traj, res_traj):
        if a.read_bytes() != b.read_bytes():
            trajectories_same = False
            differences.append(f"trajectories/{a.name} differs")
    ref_state = json.loads((ref_ckpt / STATE).read_text())
    res_state = json.loads((res_ckpt / STATE).read_text())
    state_same = True
    for field in TRAINING_STATE_FIELDS:  # a field newer than the reference's checkpoint is not compared
        if field in ref_state and ref_state.get(field) != res_state.get(field):
            state_same = False
            differences.append(f"state.json field {field} differs")
    if training_history(ref_state["history"]) != training_history(res_state["history"]):
        state_same = False
        differences.append("state.json history (metrics without timings and held-out figures) differs")
    verdicts = {
        "adapter_and_optimizer_byte_identical": tensors_same,
        "trajectories_byte_identical": trajectories_same,
        "training_state_fields_identical": state_same,
        "global_optimizer_steps": res_state["global_optimizer_steps"],
        "task_cursor": res_state["task_cursor"],
    }
    return verdicts, (differences[0] if differences else None)


def resumed_from_difference(resumed_block: dict, stop_ckpt: Path, k: int) -> str | None:
    """Why the resumed run's own `resume` block does not show a resume from `stop_ckpt` after
    update k; None when it does."""
    source = resumed_block.get("resumed_from")
    if (
        resumed_block.get("status") == "resumed"
        and source
        and Path(source).resolve() == stop_ckpt.resolve()
        and resumed_block.get("resumed_after_update") == k
    ):
        return None
    return (
        f"the resumed run did not resume from {stop_ckpt} after update {k} (its report's resume block: status "
        f"{resumed_block.get('status')}, resumed_from {source}, resumed_after_update "
        f"{resumed_block.get('resumed_after_update')})"
    )


def verify_resume(run_dir: Path, args: list[str], interrupt_after: int) -> dict:
    """Run the interrupted and resumed twins of this run; returns the report's `resume` block."""
    interrupted, resumed = run_dir / "resume_check" / "interrupted", run_dir / "resume_check" / "resumed"
    for twin in (interrupted, resumed):  # a stopped check's leftovers go, unless a process of it still runs there
        try:
            held = flock_folder(twin) if twin.is_dir() else None
        except BlockingIOError:
            raise MiniverlError(
                f"resume check: {twin} is in use by a run of an earlier check, still going on (left by a command "
                "that was killed); wait until it ends, then run the same command again"
            ) from None
        if held is not None:
            os.close(held)
    shutil.rmtree(run_dir / "resume_check", ignore_errors=True)
    block = {
        "status": "mismatch",
        "excluded_run_identity_field": EXCLUDED_RUN_IDENTITY_FIELD,
        "interrupted_run": str(interrupted),
        "resumed_run": str(resumed),
        "adapter_and_optimizer_byte_identical": False,
        "trajectories_byte_identical": False,
        "training_state_fields_identical": False,
        "global_optimizer_steps": None,
        "task_cursor": None,
        "interrupt_checkpoint_bytes": None,
        "resume_load_seconds": None,
        "resumed_from_checkpoint": None,
        "resumed_after_update": None,
        "first_difference": None,
    }
    try:
        run_child(args, [f"trainer.stop_after_updates={interrupt_after}"], interrupted)
        stop_ckpt = checkpoints_in(interrupted)[-1]
        block["interrupt_checkpoint_bytes"] = folder_bytes(stop_ckpt)
        if checkpoint_update(stop_ckpt) != interrupt_after:
            block["first_difference"] = (
                f"the interrupted run stopped at {stop_ckpt.name}, not after update {interrupt_after}"
            )
            return block
        run_child(args, [f"trainer.resume_from={interrupted}"], resumed)
        resumed_block = json.loads((resumed / REPORT).read_text())["resume"]
    except (RuntimeError, IndexError, OSError, ValueError, KeyError) as error:
        block["first_difference"] = f"the interrupted or resumed run failed: {error}"
        return block
    block.update(
        resume_load_seconds=resumed_block.get("resume_load_seconds"),
        resumed_from_checkpoint=resumed_block.get("resumed_from"),
        resumed_after_update=resumed_block.get("resumed_after_update"),
    )
    not_resumed = resumed_from_difference(resumed_block, stop_ckpt, interrupt_after)
    verdicts, difference = first_difference(run_dir, resumed)
    difference = not_resumed or difference
    block.update(verdicts, first_difference=difference, status="exact_match" if difference is None else "mismatch")
    return block


def finish_resume_check(run_dir: Path, args: list[str], k: int, write_report) -> dict:
    """Run the check; `write_report(block)` puts its verdict into the run's report and returns it.
    A Ctrl-C or SIGTERM kills the children, leaves the report `interrupted` and ends the command
    with the line that says how to finish the check."""
    log.info("resume check: interrupting a fresh run after update %d and resuming it in a new process", k)
    try:
        with raised_signals():
            block = verify_resume(run_dir, args, k)
    except SignalReceived as stop:
        write_report(pending_block(INTERRUPTED))
        command = check_command(args, run_dir)
        raise RunStopped(
            f"stopped by {stop} during the resume check; the run itself is finished and kept (report.json, "
            f"peft_adapter/; the report's resume status is {INTERRUPTED}); to finish the check, run the same "
            f"command in that folder: {command}",
            stop.signum,
        ) from None
    return write_report(block)


def report_with_check(run_dir: Path, block: dict) -> dict:
    """A later command's verdict written into the finished run's report.json and report.md (the
    run's own measurements, timings included, stay those of the command that trained it)."""
    from miniverl.trainer.report_page import write_report_page  # matplotlib, torch: not for check_is_pending
    from miniverl.trainer.run_report import with_resume_check

    report = with_resume_check(json.loads((run_dir / REPORT).read_text()), block, folder_bytes(run_dir))
    atomic_write_bytes(run_dir / REPORT, readable_json(report))
    write_report_page(report, finished_history(run_dir), run_dir)
    return report


def finished_history(run_dir: Path) -> list[dict]:
    """Every update's metrics, as the run's last checkpoint holds them."""
    return json.loads((checkpoints_in(run_dir)[-1] / STATE).read_text())["history"]
