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
    # Shuffle the prompts once per pass, seeded by data.seed (verl: data.shuffle, default true there); false:
    # file order. Either way the batches are verl's dataloader's, row for row.
    shuffle: bool = False
    # Let the plan go through the prompts more than once (verl: more than one epoch; as there, each
    # pass's last partial batch is dropped); otherwise a plan that needs more prompts than the data
    # holds is refused.
    repeat_prompts: bool = False
    # Extra arguments to the chat template (verl: data.apply_chat_template_kwargs), e.g. enable_thinking.
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The seed of that shuffle (verl: data.seed); null: torch's default generator seed, verl's default.
    seed: int | None = 1

    def __post_init__(self) -> None:
        self.train_files = path_list(self.train_files, "train_files")
        self.val_files = path_list(self.val_files, "val_files", none_ok=True)


def path_list(value: Any, key: str, none_ok: bool = False) -> list[str]:
    """One path or a list of them, as a list (null or [] an empty one where `none_ok`); anything else (a number,
    a null or empty name in the list) refused naming the key."""
    if isinstance(value, str):
        paths = [value]
    else:
        paths = [] if value is None and none_ok else value
    ok = isinstance(paths, (list, tuple)) and (none_ok or paths) and all(isinstance(p, str) and p for p in paths)
    if not ok:
        shape = "a parquet path, a list of paths or null" if none_ok else "a parquet path or a non-empty list of paths"
        raise ValueError(f"data.{key} must be {shape}, not {value!r}")
    return list(paths)
