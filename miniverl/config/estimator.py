"""Schema of `conf/estimator/`: verl v0.8.0's `distillation.distillation_loss.*` plus the actor's
`loss_agg_mode` and `clip_ratio_c`, and two keys verl added in v0.9 (`loss_agg_mode: token-sum`,
`use_chunked_topk` / `chunked_topk_chunk_size`). The schema is the same whichever verl release a run
is exported to; the export refuses what its release lacks.

Defaults are those of verl's YAML (`verl/trainer/config/distillation/distillation.yaml`), which is
what a `python3 -m verl.trainer.main_ppo` user gets; verl's dataclass defaults differ for
`topk`, `loss_max_clamp`, `log_prob_min_clamp` and `use_policy_gradient` (see docs/losses.md).
One default is miniverl's own: `use_task_rewards` is false (pure distillation), where verl's is true.
Combinations verl refuses are refused here, when the config is composed and converted.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional

from miniverl.config.actor import check_clip_ratios
from miniverl.config.bounds import check_range

# Single-sample estimators (verl's `kl_penalty` modes), the top-k forward KL, and miniverl's own
# exact full-vocabulary reverse KL (no verl version has it; verl RFC #7239 asks for one).
ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# Beyond verl v0.9 (docs/objectives.md): the top-k forward KL with a tail bucket (verl RFC #7856) and the
# reverse KL over the student's own top-k (verl #7425 / #7590), both miniverl's.
TOPK_MODES = ("forward_kl_topk", "forward_kl_topk_tail")  # the teacher's top-k log-probs
FULL_VOCAB_MODES = ("reverse_kl_full", "reverse_kl_topk")  # the teacher's whole distribution (its hidden states)
LOSS_MODES = ESTIMATOR_MODES + TOPK_MODES + FULL_VOCAB_MODES
TOKEN_SELECTIONS = ("none", "entropy", "overconfident")
ADVANTAGE_BASELINES = ("none", "batch_mean")


@dataclass
class TokenSelectionConfig:
    # Which response tokens the loss trains on (TIP, arXiv 2604.14084): none (all); entropy (the highest
    # student entropy); overconfident (low student entropy and high student-teacher divergence).
    by: str = "none"
    # Fraction of the update's response tokens kept (0, 1], at least one; the others never enter the loss's
    # backward. With task rewards the task PPO loss trains on the kept tokens too (docs/objectives.md).
    keep: float = 1.0


# verl's agg_loss modes; token-sum is verl v0.9's (docs/losses.md: what it means on one device).
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class EstimatorConfig:
    # The divergence: k1/kl, abs, k2/mse, k3/low_var_kl (single-sample), forward_kl_topk, reverse_kl_full
    # (docs/losses.md).
    loss_mode: str = "k3"
    # Teacher tokens per position of forward_kl_topk: more is closer to the full KL, costs memory.
    topk: Optional[int] = 32
    # true: the estimate is the advantage of a policy-gradient loss (k1 needs it); false: the estimate is the loss.
    use_policy_gradient: bool = False
    # verl's policy loss of that gradient. Single-valued, as in verl v0.8.0, which refuses any other for
    # distillation; kept as verl's own key so that a verl user's override meets verl's refusal, not an
    # unknown key (the conformance goldens include that refusal).
    policy_loss_mode: str = "vanilla"
    # PPO ratio clip of the distillation policy gradient (does nothing on-policy, ratio 1).
    clip_ratio: float = 0.2
    # Lower PPO clip: the ratio's floor is 1 - it (a number, as verl's distillation_loss types it).
    clip_ratio_low: float = 0.2
    # Upper PPO clip: the ratio's ceiling is 1 + it.
    clip_ratio_high: float = 0.2
    # Dual-clip bound. verl v0.8.0's distillation PG reads it from distillation.distillation_loss, which
    # has no such field, so verl always uses 3.0 (actor_rollout_ref.actor.clip_ratio_c is not read there).
    clip_ratio_c: float = 3.0
    # Clamp of the per-token estimate to +-this (verl's example: 10); null: none. Clamping stops a few terrible tokens
    # from dominating, and stops the gradient from ranking them.
    loss_max_clamp: Optional[float] = None
    # Floor on the log-probs of forward_kl_topk (verl's example: -10); null: none.
    log_prob_min_clamp: Optional[float] = None
    # forward_kl_topk only (verl v0.9's key): form the student's log-probs at the teacher's top-k ids at most
    # chunked_topk_chunk_size positions at a time; same numbers. miniverl's update takes positions in chunks
    # (hardware.logprob_chunk) forward and backward either way, so no (B, T, V) log-softmax exists without it.
    use_chunked_topk: bool = False
    # Positions (of B x T) per chunk with use_chunked_topk: smaller is less memory, more kernel launches.
    chunked_topk_chunk_size: int = 4096
    loss_agg_mode: str = "token-mean"  # verl: actor_rollout_ref.actor.loss_agg_mode
    # Task rewards beside the distillation loss: verl's PPO loss on the task advantages (see
    # `algorithm`, `reward`) + distillation_loss_coef x the distillation loss. verl's default is
    # true; miniverl's is false, pure distillation (with which a coefficient is not used).
    use_task_rewards: bool = False
    # Weight of the distillation loss beside the task PPO loss (with use_task_rewards).
    distillation_loss_coef: float = 1.0
    # gamma of the discounted future reverse KL (tinker-cookbook's kl_discount_factor): with policy gradient the
    # advantage of token t is -sum_{s>=t} gamma^(s-t) k1_s over its response; 0.0: the per-token estimate.
    kl_discount_factor: float = 0.0
    # Subtracted from the per-token estimate before the advantage is formed (and discounted): none (verl's,
    # tinker-cookbook's distillation), or batch_mean, the update's token mean of the estimate under the policy
    # that sampled it (tinker-cookbook's RL KL penalty), which keeps a discounted sum from crediting every token
    # alike for a divergence all of them share.
    advantage_baseline: str = "none"
    # The response tokens the loss trains on (docs/objectives.md).
    token_selection: TokenSelectionConfig = field(default_factory=TokenSelectionConfig)

    def __post_init__(self) -> None:
        where = "estimator"
        if self.loss_mode not in LOSS_MODES:
            raise ValueError(
                f"{where}.loss_mode={self.loss_mode!r} is not a distillation loss of verl v0.8.0 or "
                f"miniverl; choose one of {', '.join(LOSS_MODES)}"
            )
        if self.policy_loss_mode != "vanilla":
            raise ValueError(
                f"{where}.policy_loss_mode={self.policy_loss_mode!r}: verl v0.8.0 supports only 'vanilla' "
                "for distillation with policy gradient"
            )
        if self.loss_mode == "k1" and not self.use_policy_gradient:
            raise ValueError(
                f"{where}: loss_mode=k1 with use_policy_gradient=false is refused (as in verl): the gradient "
                "of k1 does not depend on the teacher; set estimator.use_policy_gradient=true or pick k3"
            )
        if self.loss_mode in FULL_VOCAB_MODES and self.use_policy_gradient:
            raise ValueError(
                f"{where}: loss_mode={self.loss_mode} with use_policy_gradient=true is refused: a KL over the "
                "vocabulary (or the student's top-k) is differentiated directly, not through the sampled token; set "
                "estimator.use_policy_gradient=false"
            )
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"{where}.loss_agg_mode={self.loss_agg_mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")
        if self.topk_loss:
            if self.topk is None or self.topk < 1:
                raise ValueError(f"{where}.topk must be a positive integer for loss_mode={self.loss_mode}")
            if self.use_policy_gradient:
                warnings.warn(
                    f"{self.loss_mode} with use_policy_gradient=true: the update uses only the sampled token's "
                    "log-prob, so the top-k signal is largely unused (verl warns the same)",
                    stacklevel=2,
                )
        check_range(f"{where}.kl_discount_factor", self.kl_discount_factor, at_least=0)
        if self.kl_discount_factor > 1:
            raise ValueError(f"{where}.kl_discount_factor={self.kl_discount_factor} must be in [0, 1]")
        if self.kl_discount_factor and not (self.use_policy_gradient and self.loss_mode in ESTIMATOR_MODES):
            raise ValueError(
                f"{where}.kl_discount_factor={self.kl_discount_factor}: the discounted future KL is an advantage, so "
                "it needs a per-token estimate (k1, k3, ...) with estimator.use_policy_gradient=true"
            )
        if self.advantage_baseline not in ADVANTAGE_BASELINES:
            raise ValueError(
                f"{where}.advantage_baseline={self.advantage_baseline!r}; "
                f"choose one of {', '.join(ADVANTAGE_BASELINES)}"
            )
        if self.advantage_baseline != "none" and not (self.use_policy_gradient and self.loss_mode in ESTIMATOR_MODES):
            raise ValueError(
                f"{where}.advantage_baseline={self.advantage_baseline}: a baseline is subtracted from an advantage, so "
                "it needs a per-token estimate (k1, k3, ...) with estimator.use_policy_gradient=true; "
                f"with this estimator set {where}.advantage_baseline=none (a recipe may set batch_mean)"
            )
        select = self.token_selection
        if select.by not in TOKEN_SELECTIONS:
            raise ValueError(f"{where}.token_selection.by={select.by!r}; choose one of {', '.join(TOKEN_SELECTIONS)}")
        if not 0 < select.keep <= 1:
            raise ValueError(f"{where}.token_selection.keep={select.keep} must be in (0, 1]")
        if select.by == "none" and select.keep != 1:
            raise ValueError(
                f"{where}.token_selection.keep={select.keep} with by=none: pick the tokens to keep "
                "(estimator.token_selection.by=entropy or overconfident)"
            )
        check_clip_ratios(where, self)
        check_range(f"{where}.topk", self.topk, at_least=1, null_ok=True)
        check_range(f"{where}.loss_max_clamp", self.loss_max_clamp, above=0, null_ok=True)
        check_range(
            f"{where}.log_prob_min_clamp", self.log_prob_min_clamp, below=0, null_ok=True, why="log-probs are <= 0"
        )
        check_range(f"{where}.distillation_loss_coef", self.distillation_loss_coef, at_least=0)
        # verl v0.9.1 does not check either key (its loop `range(0, N, chunk_size)` fails on 0 and silently
        # leaves the output unwritten for a negative size); both are refused here rather than at the first update.
        if not isinstance(self.use_chunked_topk, bool):
            raise ValueError(f"{where}.use_chunked_topk={self.use_chunked_topk!r} must be true or false")
        if isinstance(self.chunked_topk_chunk_size, bool) or not isinstance(self.chunked_topk_chunk_size, int):
            raise ValueError(f"{where}.chunked_topk_chunk_size={self.chunked_topk_chunk_size!r} must be an integer")
        check_range(f"{where}.chunked_topk_chunk_size", self.chunked_topk_chunk_size, at_least=1)

    @property
    def teacher_target(self) -> str:
        """What the teacher returns for this loss: the sampled token's log-prob, its top-k, or its whole
        next-token distribution (the report's `recipe.teacher_target`; derived, never set)."""
        if self.loss_mode in TOPK_MODES:
            return "top_k_log_probabilities"
        if self.loss_mode in FULL_VOCAB_MODES:  # reverse_kl_topk reads it at the student's top-k
            return "full_vocabulary_log_probabilities"
        return "sampled_token_log_probability"

    @property
    def uses_topk(self) -> bool:
        """The loss reads the teacher's top-k log-probs (forward_kl_topk, forward_kl_topk_tail)."""
        return self.teacher_target == "top_k_log_probabilities"

    @property
    def topk_loss(self) -> bool:
        """The loss is over a top-k (the teacher's, or the student's for reverse_kl_topk): estimator.topk is read."""
        return self.loss_mode in TOPK_MODES + ("reverse_kl_topk",)

    @property
    def uses_full_vocab(self) -> bool:
        """The loss reads the teacher's whole next-token distribution at every response position (from its
        hidden states): reverse_kl_full, and reverse_kl_topk, which reads it at the student's top-k."""
        return self.teacher_target == "full_vocabulary_log_probabilities"
