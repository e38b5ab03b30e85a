"""Schema of the `actor` and `rollout` nodes (verl: actor_rollout_ref.actor.* / .rollout.*)."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        if self.ppo_epochs != 1:
            raise ValueError("actor.ppo_epochs: on-policy distillation in miniverl runs one epoch per batch")
        if len(self.optim.betas) != 2:
            raise ValueError("actor.optim.betas must hold two numbers")


@dataclass
class RolloutConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = no top-k filtering (verl's convention)

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError("rollout.temperature must be > 0 (sampling is always on in OPD)")
        if not 0 < self.top_p <= 1:
            raise ValueError("rollout.top_p must be in (0, 1]")
