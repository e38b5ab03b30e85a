"""The run folder: what a run writes, written so that nothing is half-written or overwritten.

resolved_config.yaml   the composed config, interpolated, without Hydra's runtime node
plan.json              the compiled plan (canonical JSON; its sha256 is compiled_plan_sha256)
metrics.jsonl          one line per optimizer update (verl's metric names)
trajectories/update_<k>.safetensors   every sampled token of update k and its log-probs
peft_adapter/          the trained LoRA as a standard PEFT folder
report.json            the measurement report
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import yaml
from safetensors.torch import save_file

from miniverl.protocol import Batch
from miniverl.utils.checkpoint import checkpoints_in, trajectory_path, with_umask_mode
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import canonical_json, sha256_file, sha256_json
from miniverl.utils.run_names import (
    ADAPTER,
    CHECKPOINTS,
    METRICS,
    PLAN,
    REPORT,
    RESOLVED_CONFIG,
    TENSORBOARD,
    TRAJECTORIES,
    WANDB,
)

log = logging.getLogger(__name__)
FINISHED_MARKERS = (METRICS, REPORT, PLAN)
ERROR_FILE = "error.txt"  # main.py's one-line error in the folder of a job that failed

# What a run writes into its folder (Hydra's own .hydra/ and <job>.log are left alone).
RUN_OUTPUTS = (
    *FINISHED_MARKERS,
    "resolved_config.yaml",
    "trajectories",
    "checkpoints",
    "peft_adapter",
    "toy_models",
    "resume_check",
    TENSORBOARD,
    WANDB,
    "report.md",
    "curves.png",
    ERROR_FILE,
)


# What a run writes by these names, replacing what is there: in a folder without a run's markers
# they are someone else's (a user's notes, a copied adapter), never replaced unasked.
REPLACED_BY_NAME = (RESOLVED_CONFIG, "report.md", "curves.png", ADAPTER, CHECKPOINTS, TRAJECTORIES)


def outputs_holding(root: Path, inputs: list[tuple[str, Path]]) -> list[tuple[str, Path]]:
    """The inputs (setting, path) that lie in a run output of `root` (its peft_adapter/, toy_models/, ...),
    which trainer.overwrite=true would remove before the run reads them."""
    outputs = [(root / name).resolve() for name in RUN_OUTPUTS]
    return [(key, path) for key, path in inputs if any(path.resolve().is_relative_to(out) for out in outputs)]


def holds(path: Path) -> bool:
    """A file, or a folder with something in it (an empty one a failed start left is nothing)."""
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def holds_outputs(root: Path) -> bool:
    """A run's markers, or what a run would replace (a folder RunFolder refuses or resumes)."""
    return any((root / n).exists() for n in FINISHED_MARKERS) or any(holds(root / n) for n in REPLACED_BY_NAME)


def earlier_report(root: Path) -> dict:
    """The report.json a run left in `root`; {} if there is none or it cannot be read."""
    try:
        report = json.loads((root / REPORT).read_text())
    except (OSError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` to a temporary file beside `path`, fsync, rename: a crash leaves either the old
    file or the new one. The one way miniverl writes a file a user reads (checkpoints add a folder
    rename on top: utils/checkpoint.py)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: a parallel sweep's jobs write one summary
    write(tmp)
    with_umask_mode(tmp)  # safetensors' own 0600, as every other file
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def readable_json(value) -> bytes:
    """report.json's form: indented, keys sorted."""
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def flock_folder(root: Path, waiting: str | None = None) -> int | None:
    """An exclusive lock on the folder `root` (flock on the folder itself: no file is added); returns the
    descriptor that holds it (closing it releases the lock), or None where the file system has no such
    locks (Windows; some network mounts). Held by another process: with `waiting`, that line goes to
    stderr and this one waits for it; without, BlockingIOError."""
    try:
        import fcntl
    except ImportError:
        return None
    descriptor = os.open(root, os.O_RDONLY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is None:
                raise
            print(waiting, file=sys.stderr, flush=True)
            fcntl.flock(descriptor, fcntl.LOCK_EX)
    except BlockingIOError:
        os.close(descriptor)
        raise
    except OSError:
        os.close(descriptor)
        return None
    return descriptor


def locked(root: Path) -> int | None:
    """flock_folder(root) for as long as this run holds its folder: a second command into a folder whose
    run is going on is refused before it writes, where it would take that run's outputs for an earlier
    run's and replace them."""
    try:
        return flock_folder(root)
    except BlockingIOError:
        raise MiniverlError(
            f"run folder {root} is in use: another miniverl process is running there now; wait until it ends "
            "(then the same command resumes or refuses as usual), or choose another hydra.run.dir"
        ) from None


class RunFolder:
    def __init__(
        self, root: Path, *, continuing: bool = False, overwrite: bool = False, plan_digest: str | None = None
    ):
        """`continuing`: resuming this folder's own checkpoint, so its earlier outputs are expected;
        `overwrite`: the user asked to replace a previous run's outputs (trainer.overwrite=true);
        `plan_digest`: this run's compiled_plan_sha256. A run of the same plan that ended before its
        first checkpoint (SIGKILL, preemption, a failure in update 1: plan.json of that digest, no
        checkpoint, no report or a failed one) left nothing to resume from, so, like verl's
        resume_mode=auto without a checkpoint, the run starts again in its folder."""
        self.root = Path(root)
        self.unlock = None  # closes the descriptor holding the folder's lock, once: release(), or at exit
        if self.root.is_dir():  # before anything here is read as a run's
            self.hold(locked(self.root))
        try:
            self.take(continuing, overwrite, plan_digest)
        except BaseException:  # refused: the folder is not this run's to hold
            self.release()
            raise
        if self.unlock is None:
            self.hold(locked(self.root))
        self.trajectory_digests: list[str] = []

    def take(self, continuing: bool, overwrite: bool, plan_digest: str | None) -> None:
        """The folder for this run, as __init__ says, or a one-line refusal before anything is written."""
        self.earlier = earlier_report(self.root)  # {} if none, or unreadable
        taken = [name for name in FINISHED_MARKERS if (self.root / name).exists()]
        restart = taken and not continuing and not overwrite and self.ended_before_first_checkpoint(plan_digest)
        if restart:
            failure = self.earlier.get("failure")
            why = failure.get("reason") if isinstance(failure, dict) else None
            log.warning(
                "run folder %s holds a run of this plan that stopped before its first checkpoint "
                "(no checkpoint; no report, or a failed one%s): this command's run takes its place",
                self.root,
                f": {why}" if why else "",
            )
        held = [name for name in REPLACED_BY_NAME if holds(self.root / name)]
        if (taken or held) and (overwrite or restart) and not continuing:
            # A run's outputs all go; in a folder without a run, only what a run would replace (a
            # foreign checkpoints/ left in place would pass for this run's).
            if overwrite:
                log.warning(
                    "trainer.overwrite: removing %s from %s", "its run" if taken else ", ".join(held), self.root
                )
            self.discard(RUN_OUTPUTS if taken else held)
            taken = held = []
        if taken and not continuing:
            status = f"status {self.earlier['status']}: " if "status" in self.earlier else ""
            resume = f"resume it with trainer.resume_from={self.root}, " if checkpoints_in(self.root) else ""
            raise MiniverlError(
                f"run folder {self.root} already holds a run ({status}{', '.join(taken)}"
                + ("" if resume else "; no checkpoint to resume")
                + f"); choose another hydra.run.dir, {resume}or replace it with trainer.overwrite=true"
            )
        if held and not continuing:
            raise MiniverlError(
                f"run folder {self.root} holds {', '.join(held)} but no run of miniverl's (no "
                f"{', '.join(FINISHED_MARKERS)}): a run here would replace them; choose another hydra.run.dir, or "
                "replace them with trainer.overwrite=true"
            )
        self.fresh = not continuing  # not resuming this folder's own run
        # What the folder holds before this run writes anything (a foreign checkpoints/, say): take_back leaves it.
        self.found = {name for name in RUN_OUTPUTS if (self.root / name).exists()}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / TRAJECTORIES).mkdir(exist_ok=True)
        except OSError as error:
            raise MiniverlError(f"cannot create the run folder {self.root}: {error.strerror}") from None

    def hold(self, descriptor: int | None) -> None:
        if descriptor is not None:
            self.unlock = weakref.finalize(self, os.close, descriptor)

    def release(self) -> None:
        """Unlock the folder: the run is over (finished, stopped or failed) in this process."""
        if self.unlock is not None:
            self.unlock()

    def discard(self, names=RUN_OUTPUTS) -> None:
        """Remove these run outputs (Hydra's .hydra/ and log stay): all of them for trainer.overwrite."""
        for name in names:
            target = self.root / name
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)

    def take_back(self) -> None:
        """What a fresh run whose set-up failed wrote here, and only that: its plan.json alone would
        make the corrected command refuse the folder as a run's."""
        if self.fresh:
            self.discard([name for name in RUN_OUTPUTS if name not in self.found])

    def ended_before_first_checkpoint(self, plan_digest: str | None) -> bool:
        """A run of this plan killed, or failed in its first update, before any checkpoint: nothing
        of it can be resumed (a failed run's line says to run the command again once fixed)."""
        plan = self.root / PLAN
        return (
            plan_digest is not None
            and plan.is_file()
            and (self.earlier.get("status") == "failed" or not (self.root / REPORT).exists())
            and not checkpoints_in(self.root)
            and sha256_file(plan) == plan_digest
        )

    def path(self, name: str) -> Path:
        return self.root / name

    def write_json(self, name: str, value, *, canonical: bool = False) -> Path:
        data = canonical_json(value) if canonical else readable_json(value)
        atomic_write_bytes(self.path(name), data)
        return self.path(name)

    def write_yaml(self, name: str, value: dict) -> Path:
        atomic_write_bytes(self.path(name), yaml.safe_dump(value, sort_keys=False).encode())
        return self.path(name)

    def rewrite_metrics(self, history: list[dict], create: bool = True) -> None:
        """metrics.jsonl as of a resumed checkpoint (drops lines of updates after it); without `create`
        (trainer.logger without jsonl) only where the earlier run wrote one: its lines stay, in step with it."""
        if not create and not self.path(METRICS).exists():
            return
        lines = "".join(json.dumps(m, sort_keys=True) + "\n" for m in history)
        atomic_write_bytes(self.path(METRICS), lines.encode())

    def append_metrics(self, metrics: dict) -> None:
        with open(self.path(METRICS), "a", encoding="utf-8") as handle:
            handle.write(json.dumps(metrics, sort_keys=True) + "\n")

    def write_trajectory(self, update: int, batch: Batch) -> str:
        """One safetensors file per update; returns its sha256 (the trajectory digest chains them)."""
        path = trajectory_path(self.root, update)
        tensors = {name: t.float() if t.is_floating_point() else t for name, t in batch.tensors().items()}
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"update": str(update)}))
        self.trajectory_digests.append(sha256_file(path))
        return self.trajectory_digests[-1]

    def copy_trajectories(self, run_dir: Path, updates: int) -> None:
        """The trajectory files of updates 1..`updates` of the run in `run_dir` (a resume elsewhere)."""
        for update in range(1, updates + 1):
            source = trajectory_path(run_dir, update)
            shutil.copyfile(source, trajectory_path(self.root, update))

    @property
    def trajectory_sha256(self) -> str:
        """sha256 of the canonical JSON list of every update file's sha256, in update order."""
        return sha256_json(self.trajectory_digests)
