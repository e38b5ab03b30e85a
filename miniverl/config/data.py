"""Schema of `conf/data/`: a verl-format parquet of prompts (verl's `data.*` keys)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataConfig:
    # One path or a list of paths (verl: data.train_files). Relative paths are taken from the
    # directory the command runs in; the prompts miniverl ships (data/) are found from any directory.
    train_files: Any = "data/toy_prompts.parquet"
    # Held-out prompts for the distillation-progress measurement (verl: data.val_files); never trained on.
    val_files: Any = None
    # The parquet column that holds the chat messages (verl: data.prompt_key).
    prompt_key: str = "prompt"
    # verl: drop prompts over max_prompt_length instead of failing (truncation=error otherwise).
    filter_overlong_prompts: bool = False
    # Shuffle the prompts once per pass, seeded by data.seed (verl: data.shuffle); false: file order.
    shuffle: bool = False
    # Let the plan go through the prompts more than once (verl: more than one epoch); otherwise a
    # plan that needs more prompts than the data holds is refused.
    repeat_prompts: bool = False
    # Extra arguments to the chat template (verl: data.apply_chat_template_kwargs), e.g. enable_thinking.
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The seed of that shuffle (verl: data.seed).
    seed: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.train_files, str):
            self.train_files = [self.train_files]
        self.train_files = list(self.train_files)
        if not self.train_files or not all(isinstance(p, str) and p for p in self.train_files):
            raise ValueError("data.train_files must be a parquet path or a non-empty list of paths")
        if isinstance(self.val_files, str):
            self.val_files = [self.val_files]
        self.val_files = list(self.val_files or [])
