"""Schema of the `recipe` node: the numbers of an experiment (set by `conf/recipe/<name>.yaml`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from miniverl.config.bounds import check_range


@dataclass
class RecipeConfig:
    # The recipe's name (conf/recipe/<name>.yaml), recorded in the report.
    name: str = "default"
    # The profile identity the report carries (a recipe that changes what it computes gets a new one).
    profile: str = "verl-opd-v0.8-single-gpu-pg-k1-v1"
    logical_batch: int = 4  # prompts per optimizer update (verl: data.train_batch_size = ppo_mini_batch_size)
    # Optimizer steps of the run (verl: trainer.total_training_steps).
    optimizer_updates: int = 8
    # The exact-resume check after the run: two more runs in fresh processes, stopped after update
    # k and resumed (null: no check; see resume_check_after).
    interrupt_after_updates: Optional[int] = None
    # Run that check in every job of a Hydra multirun too (it triples each job's time).
    resume_check_in_sweeps: bool = False
    prompt_limit: int = 128  # verl: data.max_prompt_length
    response_limit: int = 64  # verl: data.max_response_length

    def __post_init__(self) -> None:
        for key in ("logical_batch", "optimizer_updates", "prompt_limit", "response_limit"):
            check_range(f"recipe.{key}", getattr(self, key), at_least=1)
        after = self.interrupt_after_updates
        check_range("recipe.interrupt_after_updates", after, at_least=1, null_ok=True, why="null: no resume check")

    @property
    def resume_check_after(self) -> int | None:
        """The update the recipe's own resume check interrupts after: interrupt_after_updates when
        it lies inside the run, else half the run (a run of fewer updates than the preset's); None
        when it is off or the run has a single update."""
        k, n = self.interrupt_after_updates, self.optimizer_updates
        if k is None or n < 2:
            return None
        return k if k < n else n // 2

    def resume_check_in(self, sweep: bool) -> int | None:
        """resume_check_after for this job: None in a sweep job unless resume_check_in_sweeps."""
        return self.resume_check_after if (self.resume_check_in_sweeps or not sweep) else None

    @property
    def resume_check_note(self) -> str | None:
        """One line on how the resume check departs from interrupt_after_updates (None: as set)."""
        k, n = self.interrupt_after_updates, self.optimizer_updates
        if k is None or k < n:
            return None
        if n < 2:
            return f"resume check skipped: recipe.optimizer_updates={n} leaves no update to interrupt after"
        return (
            f"resume check after update {n // 2}: recipe.interrupt_after_updates={k} is not before "
            f"recipe.optimizer_updates={n}"
        )
