"""Schema of `conf/trainer/`: run control (seed, loggers, names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

LOGGERS = ("console", "jsonl")


@dataclass
class TrainerConfig:
    seed: int = 1  # every random stream of the run derives from this and the update counters
    project_name: str = "miniverl"
    experiment_name: str = "opd"
    logger: List[str] = field(default_factory=lambda: ["console", "jsonl"])
    progress_bar: bool = True

    def __post_init__(self) -> None:
        unknown = [name for name in self.logger if name not in LOGGERS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger(s) {unknown}; choose from {', '.join(LOGGERS)}")
