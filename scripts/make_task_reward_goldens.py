"""Golden values for task rewards beside distillation, computed by verl v0.8.0's own functions.

    python scripts/make_task_reward_goldens.py [OUT.json]    # default tests/data/verl-0.8.0-task-rewards.json

Needs verl 0.8.0 importable with its dependencies (ray, tensordict: `pip install verl==0.8.0` in a
venv of its own; miniverl's test venv installs verl without dependencies, which is enough for its
YAML but not to import its code). Nothing of miniverl is imported: the file is verl's answer.

Cases (float64, fixed seed):
- `task_ppo`: verl's `trainer/distillation/losses.distillation_ppo_loss` called as verl's actor
  calls it at the end of a micro-batch (student_logits=None), on one device (dp_size 1, the batch's
  token and row counts as global batch info), inputs in verl's no-padding layout; the loss, its
  gradient with respect to the response log-probs, and the metrics.
- `grpo_advantage`, `rloo_advantage`: `core_algos.compute_grpo_outcome_advantage` /
  `compute_rloo_outcome_advantage` on token-level rewards and a group index.
- `reward_score`: `verl.utils.reward_score.default_compute_score` on solution strings (and
  `gsm8k.compute_score(method="flexible")`, the rule miniverl uses for its toy data source).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict
from verl.trainer.distillation.losses import distillation_ppo_loss
from verl.trainer.ppo import core_algos
from verl.utils.reward_score import default_compute_score, gsm8k
from verl.workers.config import DistillationConfig, DistillationLossConfig, FSDPActorConfig

SEED = 20261201
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "verl-0.8.0-task-rewards.json"


def value(metric):
    """A verl Metric of one micro-batch (or a plain number) as a float."""
    v = metric.values[0] if hasattr(metric, "values") else metric
    return float(v.item() if isinstance(v, torch.Tensor) else v)


def flat_layout(padded: torch.Tensor, prompt_lens: list[int], response_lens: list[int]) -> torch.Tensor:
    """(B, R) response values -> verl's no-padding layout: per row prompt_len + response_len entries,
    the response value of position t at prompt_len - 1 + t (verl's log-probs are shifted by one)."""
    parts = []
    for row, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        seq = torch.zeros(p + r, *padded.shape[2:], dtype=padded.dtype)
        seq[p - 1 : p - 1 + r] = padded[row, :r]
        parts.append(seq)
    return torch.cat(parts)


def task_ppo_case(rng: torch.Generator, settings: dict) -> dict:
    b, t, p = settings.pop("B"), settings.pop("T"), 3
    response_lens = settings.pop("response_lens")
    mask = torch.zeros(b, t, dtype=torch.float64)
    for row, r in enumerate(response_lens):
        mask[row, :r] = 1.0
    log_prob = -torch.rand(b, t, generator=rng, dtype=torch.float64) * 4
    old_log_prob = log_prob + (torch.rand(b, t, generator=rng, dtype=torch.float64) - 0.5) * 0.6
    teacher = -torch.rand(b, t, generator=rng, dtype=torch.float64) * 6
    scores = torch.randint(0, 2, (b,), generator=rng).to(torch.float64)
    advantages = ((scores - scores.mean()) / (scores.std() + 1e-6))[:, None] * mask
    prompt_lens = [p] * b

    actor = FSDPActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=b,
        ppo_micro_batch_size_per_gpu=b,
        rollout_n=1,
        use_dynamic_bsz=False,
        loss_agg_mode=settings["loss_agg_mode"],
        clip_ratio=settings["actor_clip_ratio"],
        clip_ratio_low=settings["actor_clip_ratio_low"],
        clip_ratio_high=settings["actor_clip_ratio_high"],
        clip_ratio_c=settings["actor_clip_ratio_c"],
        loss_scale_factor=t if settings["loss_agg_mode"] == "seq-mean-token-sum-norm" else None,
    )
    loss_config = DistillationLossConfig(
        loss_mode=settings["loss_mode"],
        use_policy_gradient=settings["use_policy_gradient"],
        use_task_rewards=settings["use_task_rewards"],
        distillation_loss_coef=settings["distillation_loss_coef"],
        loss_max_clamp=settings["loss_max_clamp"],
        log_prob_min_clamp=None,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
    )
    distillation = DistillationConfig(enabled=False, distillation_loss=loss_config)

    flat = flat_layout(log_prob, prompt_lens, response_lens).requires_grad_(True)
    attention = torch.cat([torch.ones(b, p, dtype=torch.long), mask.long()], dim=1)
    data = TensorDict(
        {
            "prompts": torch.ones(b, p, dtype=torch.long),
            "responses": torch.ones(b, t, dtype=torch.long),
            "attention_mask": attention,
            "response_mask": mask,
            "old_log_probs": old_log_prob,
            "advantages": advantages,
            "teacher_logprobs": flat_layout(teacher[..., None], prompt_lens, response_lens),
        },
        batch_size=[],
    )
    data["dp_size"] = 1
    data["batch_num_tokens"] = int(mask.sum())
    data["global_batch_size"] = int((mask.sum(-1) > 0).sum())
    loss, metrics = distillation_ppo_loss(
        actor, distillation, model_output={"log_probs": flat}, data=data, student_logits=None
    )
    loss.backward()
    grad = torch.zeros(b, t, dtype=torch.float64)
    offset = 0
    for row, (pl, r) in enumerate(zip(prompt_lens, response_lens)):
        grad[row, :r] = flat.grad[offset + pl - 1 : offset + pl - 1 + r]
        offset += pl + r
    return {
        "kind": "task_ppo",
        **settings,
        "inputs": {
            "log_prob": log_prob.tolist(),
            "old_log_prob": old_log_prob.tolist(),
            "teacher_log_prob": teacher.tolist(),
            "advantages": advantages.tolist(),
            "response_mask": mask.tolist(),
        },
        "expected": {
            "loss": float(loss),
            "grad_log_prob": grad.tolist(),
            "metrics": {k: value(v) for k, v in sorted(metrics.items())},
        },
    }


def advantage_case(rng: torch.Generator, kind: str, norm: bool | None) -> dict:
    groups, n, t = 3, 4, 5
    b = groups * n
    index = np.repeat(np.arange(groups), n)
    index[-1] = groups  # a group of one sample
    response_lens = torch.randint(1, t + 1, (b,), generator=rng).tolist()
    mask = torch.zeros(b, t, dtype=torch.float32)
    rewards = torch.zeros(b, t, dtype=torch.float32)
    scores = torch.randint(0, 3, (b,), generator=rng).to(torch.float32) / 2  # 0, 0.5, 1
    scores[:n] = 1.0  # a group whose samples all score alike: zero advantages
    for row, r in enumerate(response_lens):
        mask[row, :r] = 1.0
        rewards[row, r - 1] = scores[row]
    if kind == "grpo_advantage":
        advantages, _ = core_algos.compute_grpo_outcome_advantage(
            rewards.clone(), mask, index, norm_adv_by_std_in_grpo=norm
        )
    else:
        advantages, _ = core_algos.compute_rloo_outcome_advantage(rewards.clone(), mask, index)
    case = {"kind": kind, "dtype": "float32"}
    if norm is not None:
        case["norm_adv_by_std_in_grpo"] = norm
    case["inputs"] = {"token_level_rewards": rewards.tolist(), "response_mask": mask.tolist(), "index": index.tolist()}
    case["expected"] = {"advantages": advantages.tolist()}
    return case


SOLUTIONS = (
    ("openai/gsm8k", "She has 3 + 4 = 7 apples.\n#### 7", "7"),
    ("openai/gsm8k", "So the total is 1,234 dollars. #### 1,234", "1234"),
    ("openai/gsm8k", "#### 5 first, then corrected: #### 6", "6"),
    ("openai/gsm8k", "#### 5 first, then corrected: #### 6", "5"),
    ("openai/gsm8k", "The answer is 7.", "7"),
    ("openai/gsm8k", "#### -3", "-3"),
    ("openai/gsm8k", "#### $12", "12"),
    ("openai/gsm8k", "x" * 400 + " #### 9", "9"),
    ("openai/gsm8k", "#### 9 " + "x" * 400, "9"),
    ("lighteval/MATH", "We get $\\boxed{\\frac{1}{2}}$.", "\\frac12"),
    ("lighteval/MATH", "so \\boxed{0.5}", "\\frac{1}{2}"),
    ("lighteval/MATH", "\\boxed{\\dfrac{3}{4}}", "3/4"),
    ("HuggingFaceH4/MATH-500", "\\boxed{x = 5}", "5"),
    ("HuggingFaceH4/MATH-500", "\\boxed{\\left( 1, 2 \\right)}", "(1,2)"),
    ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{10\\%}", "10"),
    ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{90^\\circ}", "90"),
    ("lighteval/MATH", "\\boxed{\\sqrt2}", "\\sqrt{2}"),
    ("lighteval/MATH", "first \\boxed{1} then \\boxed{2}", "2"),
    ("lighteval/MATH", "first \\boxed{1} then \\boxed{2}", "1"),
    ("lighteval/MATH", "no box here: 5", "5"),
    ("lighteval/MATH", "\\boxed 7$ done", "7"),
    ("lighteval/MATH", "\\fbox{7}", "7"),
    ("lighteval/MATH", "\\boxed{5 \\text{ cm}}", "5"),
    ("lighteval/MATH", "\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("lighteval/MATH", "\\boxed{.5}", "\\frac{1}{2}"),
    ("lighteval/MATH", "\\boxed{\\frac{1}{2}", "\\frac{1}{2}"),
)
FLEXIBLE = (
    ("9", "9"),
    ("The sum is 142.", "142"),
    ("12 and then 13", "13"),
    ("12 and then 13", "12"),
    ("no digits", "1"),
    ("-4", "-4"),
    ("1,000", "1000"),
    ("ends with a dot 5.", "5."),
)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    random.seed(SEED)
    rng = torch.Generator().manual_seed(SEED)
    base = dict(
        B=4, T=6, response_lens=[6, 3, 5, 1], loss_mode="k1", use_policy_gradient=True, loss_agg_mode="token-mean",
        loss_max_clamp=None, use_task_rewards=True, distillation_loss_coef=1.0, actor_clip_ratio=0.2,
        actor_clip_ratio_low=0.2, actor_clip_ratio_high=0.2, actor_clip_ratio_c=3.0,
    )  # fmt: skip
    variants = (
        {},
        {"distillation_loss_coef": 0.3},
        {"loss_agg_mode": "seq-mean-token-mean", "distillation_loss_coef": 2.0},
        {"loss_agg_mode": "seq-mean-token-sum"},
        {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_max_clamp": 1.0},
        {"actor_clip_ratio_low": 0.1, "actor_clip_ratio_high": 0.28, "actor_clip_ratio_c": 2.0},
        {"loss_mode": "k3", "use_policy_gradient": False},
        {"loss_mode": "k3", "use_policy_gradient": False, "distillation_loss_coef": 0.1},
        {"loss_mode": "k2", "use_policy_gradient": True, "loss_max_clamp": 0.5},
        {"use_task_rewards": False, "distillation_loss_coef": 0.3},  # the coefficient is then not read
        {"response_lens": [0, 4, 6, 2]},  # a row without response tokens
    )
    cases = [task_ppo_case(rng, {**base, **v}) for v in variants]
    cases += [advantage_case(rng, "grpo_advantage", norm) for norm in (True, False)]
    cases += [advantage_case(rng, "rloo_advantage", None)]
    cases += [
        {
            "kind": "reward_score",
            "data_source": source,
            "solution_str": solution,
            "ground_truth": truth,
            "expected": {"score": float(default_compute_score(source, solution, truth))},
        }
        for source, solution, truth in SOLUTIONS
    ]
    cases += [
        {
            "kind": "reward_score",
            "data_source": "miniverl/toy_arithmetic",
            "verl_function": "gsm8k.compute_score(method='flexible')",
            "solution_str": solution,
            "ground_truth": truth,
            "expected": {"score": float(gsm8k.compute_score(solution, truth, method="flexible"))},
        }
        for solution, truth in FLEXIBLE
    ]
    golden = {
        "source": "verl v0.8.0: trainer/distillation/losses.distillation_ppo_loss, "
        "trainer/ppo/core_algos.compute_grpo_outcome_advantage / compute_rloo_outcome_advantage, "
        "utils/reward_score.default_compute_score and gsm8k.compute_score",
        "made_by": "scripts/make_task_reward_goldens.py",
        "dtype": "float64",
        "seed": SEED,
        "cases": cases,
    }
    out.write_text(json.dumps(golden) + "\n")
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
