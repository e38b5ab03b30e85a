"""Check miniverl.losses against golden vectors computed by verl's own functions (v0.8.0, v0.9.1).

    python -m miniverl.conformance tests/data/verl-0.8.0-opd-loss.json [--dtype float64|float32] [--rtol R]
    python -m miniverl.conformance tests/data/verl-0.9.1-opd-loss.json
    python -m miniverl.conformance tests/data/verl-0.8.0-task-rewards.json

The second file (scripts/make_task_reward_goldens.py) holds task rewards beside distillation:
verl's `distillation_ppo_loss` with the task PPO loss (`task_ppo`), its GRPO and RLOO advantages,
and its rule rewards (`reward_score`).

Every case runs through the same functions the actor uses (miniverl.losses), with gradients from
torch.autograd. Each mismatch is printed as `case <i> (<description>): <quantity>: expected <e> got <g>`;
the last line is `conformance: N/M cases match verl <version>`, the release the file was computed with
(`golden_version`). The file's `refused` configurations must be refused by EstimatorConfig and its
`warned` ones accepted with a warning, except those marked `export_only`: verl's answer to them
changed between releases, and miniverl's config, the same for every release, cannot give both (the
export to each release enforces them); they are listed, not checked. Exit status: 0 when everything
matches, 1 on any mismatch, 2 when the file cannot be read.
"""

from __future__ import annotations

import json
import re
import warnings
from typing import Any

import torch

from miniverl.config.actor import ActorConfig
from miniverl.config.estimator import EstimatorConfig
from miniverl.utils.reward_score import default_compute_score, math_dapo_score, rule_for
from miniverl.workers.advantages import grpo_outcome_advantage, rloo_outcome_advantage
from miniverl.workers.losses import distillation_loss
from miniverl.workers.task_loss import distillation_ppo_loss
from miniverl.workers.topk_loss import forward_kl_topk, forward_kl_topk_terms, topk_chunk_size

# Relative tolerances. Estimator cases reproduce verl's float64 arithmetic closely; verl computed the
# top-k KL in float32, so float64 runs can only agree with it to float32 precision.
DEFAULT_RTOL = {
    "float64": {"estimator": 1e-9, "forward_kl_topk": 1e-6, "task_ppo": 1e-7, "advantage": 1e-6, "reward_score": 0.0},
    "float32": {"estimator": 1e-5, "forward_kl_topk": 1e-5, "task_ppo": 1e-5, "advantage": 1e-6, "reward_score": 0.0},
}
# verl's task PPO loss runs on a boolean mask: its clip fractions come out in float32 (`.float()`)
# and seq-mean-token-mean adds its 1e-8 to an integer token count in float32 (where it vanishes),
# whatever the inputs' dtype, so float64 agrees with that path to ~1e-7 (task_ppo) and its clip
# fractions to float32 precision. The distillation path keeps the float mask: 1e-9 there.
FLOAT32_IN_VERL = frozenset({"actor/pg_clipfrac", "actor/pg_clipfrac_lower"})
FLOAT32_RTOL = 1e-6
# Scale floor of the tolerance (see _close). In float32 the inputs themselves (O(1) log-probs) are
# rounded by ~1e-7 absolute, so quantities formed by cancellation (ppo_kl ~1e-4, a k3 of ~1e-6) can
# only be checked absolutely: float32 compares within rtol * max(|expected|, 1).
SCALE_FLOOR = {"float64": 0.0, "float32": 1.0}

_ESTIMATOR_FIELDS = (
    "loss_mode", "use_policy_gradient", "loss_agg_mode", "loss_max_clamp",
    "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c",
)  # fmt: skip
_TOPK_FIELDS = (
    "loss_mode", "use_policy_gradient", "topk", "log_prob_min_clamp", "loss_agg_mode", "loss_max_clamp",
    "use_chunked_topk", "chunked_topk_chunk_size",
)  # fmt: skip
_TASK_FIELDS = (
    "loss_mode", "use_policy_gradient", "loss_agg_mode", "loss_max_clamp", "use_task_rewards", "distillation_loss_coef",
)  # fmt: skip
_ACTOR_CLIP_FIELDS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")  # as actor_<field> in a case
ADVANTAGE_KINDS = ("grpo_advantage", "rloo_advantage")
DEFAULT_VERSION = "v0.8.0"  # golden files from before `verl_version` was recorded are v0.8.0's
# Keys of a refused/warned entry that describe it rather than configure EstimatorConfig.
_ENTRY_NOTES = ("verl", "export_only")


def golden_version(data: dict) -> str:
    """The verl release a golden file was computed with, as `vX.Y.Z`: its `verl_version`, else the
    first `verl vX.Y.Z` of its `source`, else v0.8.0."""
    version = data.get("verl_version")
    if isinstance(version, str) and version.strip():
        version = version.strip()
        return version if version.startswith("v") else f"v{version}"
    found = re.search(r"\bverl\s+v?(\d+\.\d+\.\d+)", str(data.get("source", "")))
    return f"v{found.group(1)}" if found else DEFAULT_VERSION


def rtol_kind(kind: str | None) -> str | None:
    """The DEFAULT_RTOL entry of a case kind."""
    return "advantage" if kind in ADVANTAGE_KINDS else kind


def describe(case: dict) -> str:
    """Short human label of a case, e.g. `k3 direct seq-mean-token-mean clamp=0.5`."""
    kind = case.get("kind")
    if kind == "reward_score":
        return f"reward {case.get('data_source')} {str(case.get('solution_str'))[:24]!r}"
    if kind in ADVANTAGE_KINDS:
        norm = case.get("norm_adv_by_std_in_grpo")
        return kind.replace("_advantage", "") + ("" if norm is None else f" norm_by_std={norm}")
    if kind == "task_ppo":
        task = f"task rewards coef={case.get('distillation_loss_coef')}" if case.get("use_task_rewards") else "no task"
        return f"{describe({**case, 'kind': 'estimator'})} {task}"
    if case.get("kind") == "forward_kl_topk":
        parts = [f"forward_kl_topk k={case.get('topk')}", case.get("loss_agg_mode", "?")]
        if case.get("log_prob_min_clamp") is not None:
            parts.append(f"log_prob_min_clamp={case['log_prob_min_clamp']}")
        if case.get("loss_max_clamp") is not None:
            parts.append(f"clamp={case['loss_max_clamp']}")
        if case.get("use_chunked_topk"):
            parts.append(f"chunked={case.get('chunked_topk_chunk_size')}")
        return " ".join(parts)
    path = "pg" if case.get("use_policy_gradient") else "direct"
    parts = [str(case.get("loss_mode")), path, str(case.get("loss_agg_mode"))]
    if case.get("loss_max_clamp") is not None:
        parts.append(f"clamp={case['loss_max_clamp']}")
    if case.get("use_policy_gradient") and (
        (case.get("clip_ratio_low"), case.get("clip_ratio_high"), case.get("clip_ratio_c")) != (0.2, 0.2, 3.0)
    ):
        parts.append(f"clip={case.get('clip_ratio_low')}/{case.get('clip_ratio_high')} c={case.get('clip_ratio_c')}")
    return " ".join(parts)


def _close(expected: Any, got: torch.Tensor, rtol: float, floor: float = 0.0) -> bool:
    """Max-norm relative check: max|got - expected| <= rtol * max(max|expected|, floor).

    Scaling by the largest element keeps tiny entries of a tensor (e.g. near-cancelled gradients)
    from demanding more precision than the tensor as a whole carries; NaN matches only NaN.
    """
    exp = torch.as_tensor(expected, dtype=torch.float64)
    got = got.detach().to(torch.float64).cpu()
    if exp.shape != got.shape:
        return False
    if exp.numel() == 0:
        return True
    both_nan = torch.isnan(exp) & torch.isnan(got)
    exp, got = torch.where(both_nan, 0.0, exp), torch.where(both_nan, 0.0, got)
    scale = max(float(exp.abs().max()), floor)
    err = float((got - exp).abs().max())
    return err <= rtol * scale  # False for a NaN error


def _fmt(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        x = x.detach().to(torch.float64).cpu().tolist()
    return json.dumps(x) if isinstance(x, list) else repr(x)


def _first_diff(expected: Any, got: torch.Tensor) -> str:
    """Index of the worst element, to keep mismatch lines short for tensors."""
    exp = torch.as_tensor(expected, dtype=torch.float64)
    got64 = got.detach().to(torch.float64).cpu()
    if exp.shape != got64.shape or exp.dim() == 0:
        return f"expected {_fmt(expected)} got {_fmt(got)}"
    idx = torch.nan_to_num((got64 - exp).abs(), nan=float("inf")).argmax()
    where = tuple(int(i) for i in torch.unravel_index(idx, exp.shape))
    return (
        f"expected {exp[where].item()!r} got {got64[where].item()!r} "
        f"(at {list(where)}, worst of shape {list(exp.shape)})"
    )


def _run_case(
    case: dict, dtype: torch.dtype, version: str = DEFAULT_VERSION
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Run one case of a `version` golden file; return the quantities to compare (tensors) and the metrics."""
    if case["kind"] == "reward_score":
        source, solution, truth = case["data_source"], case["solution_str"], case["ground_truth"]
        if version == "v0.8.0" and getattr(rule_for(source), "family", None) == "math_dapo":
            score = math_dapo_score(solution, truth, boxed_fallback=False)["score"]  # 0.8.0: no \boxed fallback
        else:
            score = default_compute_score(source, solution, truth)  # miniverl's rules are verl 0.9.1's
        return {"score": torch.tensor(score, dtype=torch.float64)}, {}
    if case["kind"] in ADVANTAGE_KINDS:
        return _run_advantage_case(case), {}
    inp = case["inputs"]
    mask = torch.tensor(inp["response_mask"], dtype=dtype)  # (B, T)
    # Single device, whole batch in one call: normalisers are this batch's own, T for ...-sum-norm.
    norms = dict(
        batch_num_tokens=mask.sum(),
        global_batch_size=(mask.sum(-1) > 0).sum(),
        loss_scale_factor=mask.shape[-1],
    )
    if case["kind"] == "estimator":
        est = EstimatorConfig(**{k: case[k] for k in _ESTIMATOR_FIELDS if k in case})
        log_prob = torch.tensor(inp["log_prob"], dtype=dtype, requires_grad=True)  # (B, T)
        loss, per_token, metrics = distillation_loss(
            est,
            log_prob,
            torch.tensor(inp["old_log_prob"], dtype=dtype),
            torch.tensor(inp["teacher_log_prob"], dtype=dtype),
            mask,
            **norms,
        )
        loss.backward()
        got = {"per_token_loss": per_token, "loss": loss, "grad_log_prob": log_prob.grad}
        return got, metrics
    if case["kind"] == "task_ppo":
        return _run_task_ppo_case(case, dtype, mask, norms)
    if case["kind"] == "forward_kl_topk":
        est = EstimatorConfig(**{k: case[k] for k in _TOPK_FIELDS if k in case})
        logits = torch.tensor(inp["student_logits"], dtype=dtype, requires_grad=True)  # (B, T, V)
        t_lp = torch.tensor(inp["teacher_topk_log_probs"], dtype=dtype)  # (B, T, k)
        t_ids = torch.tensor(inp["teacher_topk_ids"], dtype=torch.long)  # (B, T, k)
        loss, per_token, metrics = forward_kl_topk(est, logits, t_lp, t_ids, mask, **norms)
        loss.backward()
        terms = forward_kl_topk_terms(
            logits.detach(), t_lp, t_ids, log_prob_min_clamp=est.log_prob_min_clamp, chunk_size=topk_chunk_size(est)
        )
        got = {
            "per_token_loss": per_token,
            "loss": loss,
            "grad_student_logits": logits.grad,
            "student_mass": terms.student_mass,
            "teacher_mass": terms.teacher_mass,
            "overlap_count": terms.overlap_count,
            "overlap_token_advantage": terms.overlap_token_advantage,
        }
        return got, metrics
    raise ValueError(f"unknown case kind {case.get('kind')!r}")


def _run_task_ppo_case(case: dict, dtype: torch.dtype, mask: torch.Tensor, norms: dict):
    """verl's distillation_ppo_loss: the actor's task PPO loss + coef x the distillation loss."""
    inp = case["inputs"]
    est = EstimatorConfig(**{k: case[k] for k in _TASK_FIELDS if k in case})
    clip = ActorConfig(**{k: case[f"actor_{k}"] for k in _ACTOR_CLIP_FIELDS if f"actor_{k}" in case})
    log_prob = torch.tensor(inp["log_prob"], dtype=dtype, requires_grad=True)  # (B, T)
    old_log_prob = torch.tensor(inp["old_log_prob"], dtype=dtype)
    distill, _, metrics = distillation_loss(
        est, log_prob, old_log_prob, torch.tensor(inp["teacher_log_prob"], dtype=dtype), mask, **norms
    )
    advantages = torch.tensor(inp["advantages"], dtype=dtype)
    loss, pg_metrics = distillation_ppo_loss(est, clip, distill, log_prob, old_log_prob, advantages, mask, **norms)
    loss.backward()
    metrics.update({f"actor/{k}": v for k, v in pg_metrics.items()})  # verl's names for the task PPO loss
    metrics["distillation/loss"] = float(distill.detach())
    return {"loss": loss, "grad_log_prob": log_prob.grad}, metrics


def _run_advantage_case(case: dict) -> dict[str, torch.Tensor]:
    """verl's outcome advantages, in the dtype verl computed them in (the case's)."""
    inp, dtype = case["inputs"], getattr(torch, case.get("dtype", "float32"))
    rewards = torch.tensor(inp["token_level_rewards"], dtype=dtype)  # (B, R)
    mask = torch.tensor(inp["response_mask"], dtype=dtype)
    index = torch.tensor(inp["index"])  # (B,)
    if case["kind"] == "grpo_advantage":
        norm = case.get("norm_adv_by_std_in_grpo", True)
        return {"advantages": grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)}
    return {"advantages": rloo_outcome_advantage(rewards, mask, index)}


def check_case(
    case: dict, dtype: torch.dtype, rtol: float, floor: float = 0.0, version: str = DEFAULT_VERSION
) -> list[str]:
    """Mismatch descriptions (`<quantity>: expected .. got ..`) for one case; empty when it matches."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a case may be a warned configuration; that is checked apart
            got, metrics = _run_case(case, dtype, version)
        expected = case["expected"]
    except Exception as exc:  # a malformed or unsupported case is a mismatch, not a crash
        return [f"could not run: {type(exc).__name__}: {exc}"]
    problems = []
    for name, exp in expected.items():
        if name == "metrics":
            for key, exp_val in exp.items():
                if key not in metrics:
                    problems.append(f"metric {key}: expected {exp_val!r} got (missing)")
                elif not _close(
                    exp_val,
                    torch.tensor(metrics[key], dtype=torch.float64),
                    max(rtol, FLOAT32_RTOL) if key in FLOAT32_IN_VERL else rtol,
                    floor,
                ):
                    problems.append(f"metric {key}: expected {exp_val!r} got {metrics[key]!r}")
        elif name not in got or got[name] is None:
            problems.append(f"{name}: expected a value got (missing)")
        elif not _close(exp, got[name], rtol, floor):
            problems.append(f"{name}: {_first_diff(exp, got[name])}")
    return problems


def _config_kwargs(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k not in _ENTRY_NOTES}


def export_only(entry: dict) -> str | None:
    """Why a refused/warned entry is left to the export (its `export_only`), or None: checked here."""
    note = entry.get("export_only")
    return str(note) if note else None


def check_refused(entry: dict) -> tuple[bool, str]:
    """(refused as verl refuses?, message)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            EstimatorConfig(**_config_kwargs(entry))
    except (ValueError, NotImplementedError) as exc:
        return True, f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # e.g. TypeError for an unknown field: refused, but not clearly
        return False, f"raised {type(exc).__name__}: {exc} (expected ValueError/NotImplementedError)"
    return False, f"accepted; verl refuses it ({entry.get('verl', '?')})"


def check_warned(entry: dict) -> tuple[bool, str]:
    """(accepted with a warning, as verl?, message)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            EstimatorConfig(**_config_kwargs(entry))
    except Exception as exc:
        return False, f"refused ({type(exc).__name__}: {exc}); verl accepts it with a warning"
    if not caught:
        return False, "accepted without a warning; verl warns"
    return True, f"warns: {caught[0].message}"


def describe_config(entry: dict) -> str:
    kwargs = _config_kwargs(entry)
    overrides = kwargs.pop("verl_overrides", None) or {}
    return " ".join([*(f"{k}={v}" for k, v in kwargs.items()), *(f"{k}={v}" for k, v in overrides.items())])
