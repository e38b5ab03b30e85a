"""Schema of the `actor` and `rollout` nodes (verl: actor_rollout_ref.actor.* / .rollout.*)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from miniverl.config.bounds import check_range


@dataclass
class OptimConfig:
    # AdamW learning rate (verl: optim.lr), constant over the run.
    lr: float = 1e-5
    # AdamW betas (verl: optim.betas).
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    # AdamW epsilon (verl: optim.override_optimizer_config.eps).
    eps: float = 1e-8
    # AdamW weight decay on the LoRA weights (verl: optim.weight_decay).
    weight_decay: float = 0.01


@dataclass
class ActorConfig:
    # The student's optimizer (AdamW).
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Clip of the gradient's global norm before each step (verl: optim.clip_grad).
    grad_clip: float = 1.0
    # The task-reward PPO loss (estimator.use_task_rewards): verl's actor clip ratios. The
    # distillation policy gradient has its own (estimator.clip_ratio*), as in verl.
    clip_ratio: float = 0.2
    # Lower clip of the task PPO loss (null: clip_ratio).
    clip_ratio_low: Optional[float] = 0.2
    # Upper clip of the task PPO loss (null: clip_ratio).
    clip_ratio_high: Optional[float] = 0.2
    # Dual-clip bound of the task PPO loss (verl: clip_ratio_c).
    clip_ratio_c: float = 3.0

    def __post_init__(self) -> None:
        optim = self.optim
        check_range("actor.optim.lr", optim.lr, above=0, why="AdamW's step size (0 would train nothing)")
        check_range("actor.optim.eps", optim.eps, above=0, why="AdamW divides by sqrt(v) + eps")
        check_range("actor.optim.weight_decay", optim.weight_decay, at_least=0)
        check_range("actor.grad_clip", self.grad_clip, above=0, why="the largest gradient norm an update may take")
        check_clip_ratios("actor", self)
        if len(self.optim.betas) != 2:
            raise ValueError("actor.optim.betas must hold two numbers")
        for i, beta in enumerate(self.optim.betas):
            check_range(f"actor.optim.betas[{i}]", beta, at_least=0, below=1, why="an AdamW moment's decay")


@dataclass
class RolloutConfig:
    # Sampling temperature (verl: rollout.temperature); the teacher always scores at 1.0.
    temperature: float = 1.0
    # Nucleus sampling (1.0: off); with top_k, the rollout samples a truncated distribution.
    top_p: float = 1.0
    top_k: int = -1  # -1 = no top-k filtering (verl's convention)
    n: int = 1  # samples per prompt, each with its own sampling stream (GRPO groups with task rewards)

    def __post_init__(self) -> None:
        check_range("rollout.temperature", self.temperature, above=0, why="sampling is always on in OPD")
        check_range("rollout.top_p", self.top_p, above=0, at_most=1, why="the nucleus' share of the probability mass")
        check_range("rollout.top_k", self.top_k, at_least=-1, why="-1 (or 0) keeps every token")
        if self.n < 1:
            raise ValueError(f"rollout.n={self.n} must be >= 1 (samples per prompt)")


def check_clip_ratios(where: str, owner) -> None:
    """PPO's clip range [1 - low, 1 + high] (clip_ratio when low/high are null) must hold ratio 1,
    and the dual-clip bound lie above it; `owner` is the actor's or the estimator's config."""
    check_range(f"{where}.clip_ratio", owner.clip_ratio, above=0, below=1)
    low, high = owner.clip_ratio_low, owner.clip_ratio_high
    check_range(f"{where}.clip_ratio_low", low, above=0, below=1, null_ok=True, why="the range's floor is 1 - it")
    check_range(f"{where}.clip_ratio_high", high, above=0, null_ok=True)
    check_range(f"{where}.clip_ratio_c", owner.clip_ratio_c, above=1, why="the dual-clip bound; verl asserts the same")
