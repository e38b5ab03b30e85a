"""Schema of the `eval` node: validation, the held-out distillation-progress measurement (not part of the
compiled plan: evaluating never changes training)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from miniverl.config.bounds import check_range


@dataclass
class ValidationConfig:
    # Evaluate before training and after every N updates (and after the last); -1 = never.
    # verl's equivalent is trainer.test_freq (+ trainer.val_before_train).
    every: int = -1
    # The exact per-position reverse KL sums over the vocabulary: only for vocabularies up to this.
    exact_kl_max_vocab: int = 4096
    response_limit: Optional[int] = None  # null: recipe.response_limit

    def __post_init__(self) -> None:
        if self.every == 0 or self.every < -1:
            raise ValueError("eval.every must be a positive number of updates, or -1 (never)")
        check_range("eval.exact_kl_max_vocab", self.exact_kl_max_vocab, at_least=1)
        check_range("eval.response_limit", self.response_limit, at_least=1, null_ok=True)
