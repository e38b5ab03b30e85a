"""Schema of the `algorithm` node (verl: algorithm.*): the task advantages, and where the PPO
ratio's old log-probs come from.

Task advantages (with `estimator.use_task_rewards=true`): verl's outcome estimators over the
`rollout.n` samples of each prompt, `grpo` (group-normalised; `norm_adv_by_std_in_grpo=false` is
Dr. GRPO) or `rloo` (leave-one-out). verl's default is `gae`, which needs a critic: miniverl has
none, so its default is `grpo` (what the export writes for pure distillation too).

Old log-probs. By default the actor's: in miniverl the update's own forward gives them
(on-policy, see actor.py), where verl v0.8.0 recomputes them in a pass before the update. With
`algorithm.rollout_correction.bypass_mode=true`, as in verl, the rollout's own log-probs
(`rollout_log_probs`) are the old log-probs. In miniverl the rollout *is* the actor's model (same
weights, same precision, KV-cached decode), so the two differ by rounding only
(`training/rollout_probs_diff_max` measures it by default). Only `bypass_mode` of verl's
rollout-correction block is here: miniverl has no importance-sampling or rejection corrections
(verl's `rollout_is` / `rollout_rs`, both off by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ADV_ESTIMATORS = ("grpo", "rloo")


@dataclass
class RolloutCorrectionConfig:
    bypass_mode: bool = False  # true: old_log_probs = rollout_log_probs (verl's bypass mode)


@dataclass
class AlgorithmConfig:
    # Task advantages with task rewards: grpo or rloo (verl: algorithm.adv_estimator).
    adv_estimator: str = "grpo"
    # Divide GRPO advantages by the group's std (verl's default true; Dr. GRPO: false).
    norm_adv_by_std_in_grpo: bool = True
    # Where the old log-probs come from (verl: algorithm.rollout_correction).
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    def __post_init__(self) -> None:
        if self.adv_estimator not in ADV_ESTIMATORS:
            raise ValueError(
                f"algorithm.adv_estimator={self.adv_estimator!r}; miniverl has verl's critic-free outcome "
                f"estimators {', '.join(ADV_ESTIMATORS)} (gae needs a critic, which miniverl does not build)"
            )
