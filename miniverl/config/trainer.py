"""Schema of `conf/trainer/`: run control (seed, loggers, checkpoints, resume). Nothing here but
`seed` enters the compiled plan, so stopping and resuming never change the plan digest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")  # verl's names; jsonl is verl's `file` (exported so)
RESUME_MODES = ("auto", "disable", "resume_path")


@dataclass
class TrainerConfig:
    seed: int = 1  # every random stream of the run derives from this and the update counters
    # A label for loggers and the report (verl: trainer.project_name).
    project_name: str = "miniverl"
    # A label for loggers and the report (verl: trainer.experiment_name).
    experiment_name: str = "opd"
    # Where metrics go (verl: trainer.logger): console, jsonl (metrics.jsonl: one flat object per update; verl's
    # `file` logger writes {"step", "data"} lines), tensorboard, wandb (pip install -e '.[wandb]'; `wandb login`
    # or WANDB_MODE=offline); verl's mlflow, swanlab... are not here.
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    # tqdm's bar of updates on the console (false: one line per update).
    progress_bar: bool = True
    # verl's trainer.save_freq: a checkpoint every N updates (-1: only at a stop and at the end; verl's -1
    # saves none, not even at the end).
    save_freq: int = 1
    # verl's trainer.max_actor_ckpt_to_keep: keep only the newest N checkpoints (null: keep all, verl's
    # default, where its save_freq -1 saves none); miniverl saves after every update, so it keeps 2: the
    # newest, and the one before in case the newest is damaged.
    max_actor_ckpt_to_keep: Optional[int] = 2
    # Stop after this update as a preemption would: checkpoint, report status `interrupted`, exit 0.
    stop_after_updates: Optional[int] = None
    # verl's trainer.resume_mode: auto resumes from trainer.resume_from, or else from the latest
    # checkpoint already in the run folder (verl's auto reads only the latter); resume_path requires
    # resume_from; disable starts fresh.
    resume_mode: str = "auto"
    # A checkpoint folder, or a run folder (its latest checkpoint); verl's trainer.resume_from_path, which
    # verl reads with resume_mode=resume_path only.
    resume_from: Optional[str] = None
    # Resume in a process that computes otherwise than the one that wrote the checkpoint (other torch
    # threads, CPU kernels, GPU or package releases; utils/numerics.py): false refuses,
    # as the run would not go on byte for byte; true goes on, and the report says the resume is inexact.
    resume_inexact: bool = False
    # Replace the outputs of a run already in the run folder (otherwise such a folder is refused).
    overwrite: bool = False

    def __post_init__(self) -> None:
        unknown = [name for name in self.logger if name not in LOGGERS]
        if unknown:
            verls = " (verl's file logger is miniverl's jsonl)" if "file" in unknown else ""
            raise ValueError(f"trainer.logger: unknown logger(s) {unknown}; choose from {', '.join(LOGGERS)}{verls}")
        if self.resume_mode not in RESUME_MODES:
            raise ValueError(f"trainer.resume_mode={self.resume_mode!r}; choose one of {', '.join(RESUME_MODES)}")
        if self.resume_mode == "resume_path" and not self.resume_from:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from=<checkpoint or run folder>")
        if self.resume_mode == "disable" and self.resume_from:
            raise ValueError("trainer.resume_from is set but trainer.resume_mode=disable; drop one of them")
        if self.stop_after_updates is not None and self.stop_after_updates < 1:
            raise ValueError("trainer.stop_after_updates must be >= 1 (or null)")
        if self.max_actor_ckpt_to_keep is not None and self.max_actor_ckpt_to_keep < 1:
            raise ValueError("trainer.max_actor_ckpt_to_keep must be >= 1 (or null to keep every checkpoint)")
        if self.save_freq == 0 or self.save_freq < -1:
            raise ValueError("trainer.save_freq must be a positive number of updates, or -1")
