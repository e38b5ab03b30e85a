"""Schema of the `algorithm` node (verl: algorithm.*): where the PPO ratio's old log-probs come from.

By default the actor's: in miniverl the update's own forward gives them (on-policy, see
actor.py), where verl v0.8.0 recomputes them in a pass before the update. With
`algorithm.rollout_correction.bypass_mode=true`, as in verl, the rollout's own log-probs
(`rollout_log_probs`) are the old log-probs. In miniverl the rollout *is* the actor's model (same
weights, same precision, KV-cached decode), so the two differ by rounding only
(`training/rollout_probs_diff_max` measures it by default). Only `bypass_mode` of verl's
rollout-correction block is here: miniverl has no importance-sampling or rejection corrections
(verl's `rollout_is` / `rollout_rs`, both off by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RolloutCorrectionConfig:
    bypass_mode: bool = False  # true: old_log_probs = rollout_log_probs (verl's bypass mode)


@dataclass
class AlgorithmConfig:
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
