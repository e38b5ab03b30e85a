"""Schema of the `actor` and `rollout` nodes (verl: actor_rollout_ref.actor.* / .rollout.*)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class OptimConfig:
    lr: float = 1e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    grad_clip: float = 1.0
    ppo_epochs: int = 1
    # The task-reward PPO loss (estimator.use_task_rewards): verl's actor clip ratios. The
    # distillation policy gradient has its own (estimator.clip_ratio*), as in verl.
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = 0.2
    clip_ratio_high: Optional[float] = 0.2
    clip_ratio_c: float = 3.0

    def __post_init__(self) -> None:
        if self.ppo_epochs != 1:
            raise ValueError("actor.ppo_epochs: on-policy distillation in miniverl runs one epoch per batch")
        if len(self.optim.betas) != 2:
            raise ValueError("actor.optim.betas must hold two numbers")
        if not self.clip_ratio_c > 1.0:
            raise ValueError(
                f"actor.clip_ratio_c={self.clip_ratio_c} must be > 1 (the dual-clip bound; verl asserts the same)"
            )


@dataclass
class RolloutConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = no top-k filtering (verl's convention)
    n: int = 1  # samples per prompt, each with its own sampling stream (GRPO groups with task rewards)

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError("rollout.temperature must be > 0 (sampling is always on in OPD)")
        if not 0 < self.top_p <= 1:
            raise ValueError("rollout.top_p must be in (0, 1]")
        if self.n < 1:
            raise ValueError(f"rollout.n={self.n} must be >= 1 (samples per prompt)")
