"""Golden values of verl's on-policy distillation losses, computed by the installed verl's own functions.

    # verl 0.9.1 (what `pip install verl` gives today): writes tests/data/verl-0.9.1-opd-loss.json
    /tmp/v091/bin/python scripts/make_opd_loss_goldens.py
    # verl 0.8.0: the same grid, written where you say (tests/data/verl-0.8.0-opd-loss.json is a copy of
    # the shared file, /work/shared/conformance/, and is not overwritten)
    /tmp/v080/bin/python scripts/make_opd_loss_goldens.py /tmp/verl-0.8.0-opd-loss.regen.json
    # recompute an existing golden file's cases from its inputs and report the largest difference
    /tmp/v080/bin/python scripts/make_opd_loss_goldens.py --replay tests/data/verl-0.8.0-opd-loss.json

Needs verl importable with its dependencies (`pip install torch verl==<version>` in a venv of its
own; tensordict and ray come with it). The teacher-temperature probe imports verl's teacher loop,
which also needs `cachetools`, `uvicorn` and `fastapi` (not among verl's declared dependencies), and
verl 0.8.0 pins numpy < 2, which pyarrow >= 21 refuses (`pip install "pyarrow<21"` there). Nothing
of miniverl is imported: the file is verl's answer. The file's format is that of
/work/shared/conformance/README.md (`estimator` and `forward_kl_topk` cases, `refused` and `warned`
configurations), plus `verl_version` and `made_by`.

How verl is called (float64, fixed seed, one device):
- `estimator` cases: `verl.trainer.distillation.losses.distillation_loss` itself, called as verl's
  actor calls it, with the student's response log-probs in verl's no-padding layout (each row is
  `P` prompt positions then the `T` response positions, log-probs shifted by one as verl's model
  output is; the attention mask covers all T positions and `response_mask` masks the loss, so the
  padded positions carry the inputs' own values, as in the shared 0.8.0 file). Global batch info:
  dp_size 1, `batch_num_tokens` = the mask's sum, `global_batch_size` = rows with a response token,
  `loss_scale_factor` = T for seq-mean-token-sum-norm (None otherwise). verl 0.9 reads them from the
  micro-batch; verl 0.8.0's `distillation_loss` reads what the previous `ppo_loss` call stored in
  `actor.global_batch_info` (verl #7200), so the script stores this batch's there first, as that call
  would have. `per_token_loss` is the registered loss function's output (`kl_penalty`) clamped to
  +-loss_max_clamp, the line `distillation_loss` applies before aggregating. The gradient is taken
  with respect to the (B, T) response log-probs.
- `forward_kl_topk` cases: `verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk` on the
  (B*T, V) student logits (teacher top-k as jagged nested tensors), its outputs laid out as above,
  then `distillation_loss` (which runs the registered `compute_forward_kl_topk` and aggregates). With
  `use_chunked_topk` (verl 0.9) the chunked path runs. The gradient is with respect to the logits.
- `refused` / `warned`: each probe configuration is given to verl's `DistillationLossConfig` and
  `FSDPActorConfig` (and, for the top-k chunk size, to one run of `compute_forward_kl_topk`; for the
  teacher temperature, to the teacher manager's `_get_teacher_sampling_params`). A probe whose
  answer changed between verl releases carries `export_only` (why): miniverl's config is the same
  for every release, so only an export to this release can enforce it; `python -m
  miniverl.conformance` lists such entries and does not check them against the config.

The grid (the shared 0.8.0 file's): every estimator with policy gradient and, but k1 and kl,
directly, under every aggregation of verl 0.8.0, clamps drawn from {none, 0.5, 10}; a PPO clip
variant (0.1 / 0.28, ratios past the dual clip's 3.0, the only clip_ratio_c verl's distillation
loss reads), an on-policy case; four top-k cases. With verl >= 0.9 also: `token-sum` for every
estimator (PG and direct) and the top-k; `kl` directly under each aggregation; chunked top-k cases
(chunk sizes 1, 4 and 7 of B*T = 15 positions, so that one chunk size does not divide them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import math
import sys
from pathlib import Path

import torch
import verl
from tensordict import TensorDict
from verl.trainer.distillation import losses as distill
from verl.trainer.distillation.fsdp import losses as fsdp_losses
from verl.workers.config import DistillationConfig, DistillationLossConfig, FSDPActorConfig

SEED = 20261203
ROOT = Path(__file__).resolve().parents[1]
SHARED_COPY = ROOT / "tests" / "data" / "verl-0.8.0-opd-loss.json"
PROMPT = 2  # prompt positions per row in the no-padding layout (verl needs > 0)

ESTIMATOR_MODES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
CLAMPS = (None, 0.5, 10.0)
CLIP = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}

# Answers that changed between verl releases (see the module docstring).
CHANGED_TOKEN_SUM = "agg_loss has token-sum from verl 0.9.0 (0.8.0's ActorConfig refuses it)"
CHANGED_CHUNKED = "DistillationLossConfig has use_chunked_topk / chunked_topk_chunk_size from verl 0.9.0"
CHANGED_TEMPERATURE = "a teacher temperature other than 1.0: refused by verl 0.8.0, warned and forced to 1.0 from 0.9.0"
TEMPERATURE_KEY = "distillation.teacher_models.teacher_model.inference.temperature"
PROBES = (
    ({"loss_mode": "k1", "use_policy_gradient": False}, None),
    ({"loss_mode": "k3+", "use_policy_gradient": True}, None),
    ({"loss_mode": "bogus", "use_policy_gradient": True}, None),
    ({"loss_mode": "k1", "use_policy_gradient": True, "policy_loss_mode": "gspo"}, None),
    ({"loss_mode": "forward_kl_topk", "use_policy_gradient": True}, None),
    ({"loss_mode": "k3", "use_policy_gradient": False, "loss_agg_mode": "seq-sum"}, None),
    (
        {
            "loss_mode": "forward_kl_topk",
            "use_policy_gradient": False,
            "use_chunked_topk": True,
            "chunked_topk_chunk_size": 0,
        },
        None,
    ),
    ({"loss_mode": "k3", "use_policy_gradient": False, "loss_agg_mode": "token-sum"}, CHANGED_TOKEN_SUM),
    (
        {
            "loss_mode": "forward_kl_topk",
            "use_policy_gradient": False,
            "use_chunked_topk": True,
            "chunked_topk_chunk_size": 2,
        },
        CHANGED_CHUNKED,
    ),
    ({"verl_overrides": {TEMPERATURE_KEY: 0.7}}, CHANGED_TEMPERATURE),
)


# --------------------------------------------------------------------------------------------------
# What the installed verl has
# --------------------------------------------------------------------------------------------------


def actor_config(loss_agg_mode: str, response_length: int) -> FSDPActorConfig:
    return FSDPActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        use_dynamic_bsz=False,
        loss_agg_mode=loss_agg_mode,
        loss_scale_factor=response_length if loss_agg_mode == "seq-mean-token-sum-norm" else None,
    )


def has_token_sum() -> bool:
    try:
        actor_config("token-sum", 1)
    except ValueError:
        return False
    return True


def has_chunked_topk() -> bool:
    return "use_chunked_topk" in {f.name for f in dataclasses.fields(DistillationLossConfig)}


def loss_config(settings: dict) -> DistillationConfig:
    kwargs = dict(
        loss_mode=settings["loss_mode"],
        topk=settings.get("topk", 128),
        use_task_rewards=False,
        loss_max_clamp=settings.get("loss_max_clamp"),
        log_prob_min_clamp=settings.get("log_prob_min_clamp"),
        use_policy_gradient=settings["use_policy_gradient"],
        policy_loss_mode=settings.get("policy_loss_mode", "vanilla"),
        clip_ratio=settings.get("clip_ratio", 0.2),
        clip_ratio_low=settings.get("clip_ratio_low", 0.2),
        clip_ratio_high=settings.get("clip_ratio_high", 0.2),
    )
    for key in ("use_chunked_topk", "chunked_topk_chunk_size"):  # verl >= 0.9 only
        if key in settings:
            kwargs[key] = settings[key]
    # verl's distillation PG reads clip_ratio_c with config.get("clip_ratio_c", 3.0) from this config,
    # which has no such field: it is always 3.0 (the generated cases say so; see make_case).
    return DistillationConfig(enabled=False, distillation_loss=DistillationLossConfig(**kwargs))


# --------------------------------------------------------------------------------------------------
# verl's no-padding layout
# --------------------------------------------------------------------------------------------------


def flat_positions(b: int, t: int) -> torch.Tensor:
    """Indices, in the (B * (P + T)) flat layout, of each row's T response positions (shifted by one)."""
    rows = torch.arange(b)[:, None] * (PROMPT + t)
    return (rows + PROMPT - 1 + torch.arange(t)[None, :]).reshape(-1)


def to_flat(x: torch.Tensor) -> torch.Tensor:
    """(B, T, *) -> (B * (P + T), *), zeros elsewhere; differentiable."""
    b, t = x.shape[:2]
    flat = torch.zeros(b * (PROMPT + t), *x.shape[2:], dtype=x.dtype)
    return flat.index_copy(0, flat_positions(b, t), x.reshape(b * t, *x.shape[2:]))


def batch(mask: torch.Tensor) -> TensorDict:
    """A micro-batch as verl's actor gives it to the loss, on one device (dp_size 1)."""
    b, t = mask.shape
    data = TensorDict(
        {
            "prompts": torch.ones(b, PROMPT, dtype=torch.long),
            "responses": torch.ones(b, t, dtype=torch.long),
            # every position is in the sequence; the loss is masked by response_mask alone
            "attention_mask": torch.ones(b, PROMPT + t, dtype=torch.long),
            "response_mask": mask,
        },
        batch_size=[],
    )
    data["dp_size"] = 1
    data["batch_num_tokens"] = int(mask.sum())
    data["global_batch_size"] = int((mask.sum(-1) > 0).sum())
    return data


def run_distillation_loss(actor: FSDPActorConfig, config: DistillationConfig, model_output: dict, data: TensorDict):
    # What verl 0.8.0's distillation_loss reads (stored by the ppo_loss of the previous call); verl 0.9
    # stores the same values from `data` itself.
    actor.global_batch_info.update(
        dp_size=1,
        batch_num_tokens=data["batch_num_tokens"],
        global_batch_size=data["global_batch_size"],
        loss_scale_factor=actor.loss_scale_factor,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # verl prints its forward_kl_topk + PG warning
        return distill.distillation_loss(actor, config, model_output, data)


def value(metric) -> float:
    """A verl Metric of one micro-batch (or a plain number / scalar tensor) as a float."""
    v = metric.values[0] if hasattr(metric, "values") else metric
    return float(v.item() if isinstance(v, torch.Tensor) else v)


# --------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------


def draw_mask(rng: torch.Generator, b: int, t: int) -> torch.Tensor:
    """Left-aligned responses of random lengths; the last row often has none."""
    mask = torch.zeros(b, t, dtype=torch.float64)
    draws = torch.rand(b + 1, generator=rng, dtype=torch.float64).tolist()
    for row in range(b):
        n = 1 + min(int(draws[row] * t), t - 1)
        if row == b - 1 and b > 2 and draws[b] < 0.7:
            n = 0
        mask[row, :n] = 1.0
    return mask


def draw_estimator_inputs(rng: torch.Generator, settings: dict) -> dict:
    b = int(torch.randint(2, 6, (1,), generator=rng))
    t = int(torch.randint(3, 9, (1,), generator=rng))
    log_prob = -torch.rand(b, t, generator=rng, dtype=torch.float64) * 4
    if settings.get("on_policy"):
        old = log_prob.clone()
    else:  # wide=True: ratios up to e^1.5, past the dual clip's 3 (pg_clipfrac_lower)
        spread = 3.0 if settings.get("wide") else 1.5
        old = log_prob + (torch.rand(b, t, generator=rng, dtype=torch.float64) - 0.5) * spread
    teacher = -torch.rand(b, t, generator=rng, dtype=torch.float64) * 6
    mask = draw_mask(rng, b, t)
    return {
        "log_prob": log_prob.tolist(),
        "old_log_prob": old.tolist(),
        "teacher_log_prob": teacher.tolist(),
        "response_mask": mask.tolist(),
    }


def estimator_expected(settings: dict, inputs: dict) -> dict:
    log_prob = torch.tensor(inputs["log_prob"], dtype=torch.float64, requires_grad=True)  # (B, T)
    mask = torch.tensor(inputs["response_mask"], dtype=torch.float64)
    actor = actor_config(settings["loss_agg_mode"], mask.shape[1])
    config = loss_config(settings)
    data = batch(mask)
    data["old_log_probs"] = torch.tensor(inputs["old_log_prob"], dtype=torch.float64)
    data["teacher_logprobs"] = to_flat(torch.tensor(inputs["teacher_log_prob"], dtype=torch.float64)[..., None])
    model_output = {"log_probs": to_flat(log_prob)}
    loss, metrics = run_distillation_loss(actor, config, model_output, data)
    loss.backward()
    with torch.no_grad():
        per_token, _ = distill.get_distillation_loss_fn(settings["loss_mode"])(
            config=actor, distillation_config=config, model_output=model_output, data=data
        )
        if settings.get("loss_max_clamp") is not None:
            c = settings["loss_max_clamp"]
            per_token = per_token.clamp(min=-c, max=c)
    return {
        "per_token_loss": per_token.tolist(),
        "loss": float(loss.detach()),
        "grad_log_prob": log_prob.grad.tolist(),
        "metrics": {k: value(v) for k, v in sorted(metrics.items())},
    }


def draw_topk_inputs(rng: torch.Generator, settings: dict) -> dict:
    b, t, v, k = settings.pop("B"), settings.pop("T"), settings.pop("V"), settings["topk"]
    mask = draw_mask(rng, b, t)
    mask[0, :] = 1.0  # at least one full row
    student = torch.randn(b, t, v, generator=rng, dtype=torch.float64) * 2
    teacher = torch.log_softmax(torch.randn(b, t, v, generator=rng, dtype=torch.float64) * 2.5, dim=-1)
    top = teacher.topk(k, dim=-1)
    return {
        "student_logits": student.tolist(),
        "teacher_topk_log_probs": top.values.tolist(),
        "teacher_topk_ids": top.indices.tolist(),
        "response_mask": mask.tolist(),
    }


def topk_expected(settings: dict, inputs: dict) -> dict:
    logits = torch.tensor(inputs["student_logits"], dtype=torch.float64, requires_grad=True)  # (B, T, V)
    t_lp = torch.tensor(inputs["teacher_topk_log_probs"], dtype=torch.float64)  # (B, T, k)
    t_ids = torch.tensor(inputs["teacher_topk_ids"], dtype=torch.long)
    mask = torch.tensor(inputs["response_mask"], dtype=torch.float64)
    b, t, v = logits.shape
    k = t_ids.shape[-1]
    actor = actor_config(settings["loss_agg_mode"], t)
    config = loss_config(settings)
    # verl's logits processor: every position of the (packed) micro-batch at once, thd format
    outputs = fsdp_losses.compute_forward_kl_topk(
        student_logits=logits.reshape(1, b * t, v),
        teacher_topk_log_probs=torch.nested.as_nested_tensor([t_lp.reshape(b * t, k)], layout=torch.jagged),
        teacher_topk_ids=torch.nested.as_nested_tensor([t_ids.reshape(b * t, k)], layout=torch.jagged),
        config=config,
        data_format="thd",
    )
    per_position = {name: out.reshape(b, t) for name, out in outputs.items()}  # (B, T) each
    model_output = {name: to_flat(out) for name, out in per_position.items()}
    loss, metrics = run_distillation_loss(actor, config, model_output, batch(mask))
    loss.backward()
    with torch.no_grad():
        per_token = per_position["distillation_losses"].clamp_min(0.0)  # as the registered loss function
        if settings.get("loss_max_clamp") is not None:
            c = settings["loss_max_clamp"]
            per_token = per_token.clamp(min=-c, max=c)
    return {
        "per_token_loss": per_token.tolist(),
        "loss": float(loss.detach()),
        "grad_student_logits": logits.grad.tolist(),
        "student_mass": per_position["student_mass"].tolist(),
        "teacher_mass": per_position["teacher_mass"].tolist(),
        "overlap_count": per_position["overlap_count"].tolist(),
        "overlap_token_advantage": per_position["overlap_token_advantage"].tolist(),
        "metrics": {k: value(v) for k, v in sorted(metrics.items())},
    }


def expected(case: dict) -> dict:
    settings = {k: v for k, v in case.items() if k not in ("kind", "inputs", "expected")}
    if case["kind"] == "estimator":
        return estimator_expected(settings, case["inputs"])
    if case["kind"] == "forward_kl_topk":
        return topk_expected(settings, case["inputs"])
    raise ValueError(f"unknown case kind {case['kind']!r}")


def make_case(rng: torch.Generator, kind: str, settings: dict) -> dict:
    settings = dict(settings)
    inputs = draw_estimator_inputs(rng, settings) if kind == "estimator" else draw_topk_inputs(rng, settings)
    settings.pop("on_policy", None)
    settings.pop("wide", None)
    assert settings.get("clip_ratio_c", 3.0) == 3.0, "verl's distillation policy gradient always uses 3.0"
    case = {"kind": kind, **settings, "inputs": inputs}
    case["expected"] = expected(case)
    return case


def estimator_settings(rng: torch.Generator, mode: str, pg: bool, agg: str) -> dict:
    clamp = CLAMPS[int(torch.randint(0, len(CLAMPS), (1,), generator=rng))]
    return {"loss_mode": mode, "use_policy_gradient": pg, "loss_agg_mode": agg, "loss_max_clamp": clamp, **CLIP}


def topk_settings(agg: str, clamp: float | None, **extra) -> dict:
    return {
        "loss_mode": "forward_kl_topk",
        "use_policy_gradient": False,
        "topk": 4,
        "log_prob_min_clamp": clamp,
        "loss_agg_mode": agg,
        "B": 3,
        "T": 5,
        "V": 11,
        **extra,
    }


def grid(rng: torch.Generator, token_sum: bool, chunked: bool) -> list[dict]:
    cases = []
    for mode in ESTIMATOR_MODES:
        for pg in (True, False):
            if not pg and mode in ("k1", "kl"):  # k1 directly is refused; kl directly is an extra below
                continue
            for agg in AGG_MODES:
                cases.append(make_case(rng, "estimator", estimator_settings(rng, mode, pg, agg)))
    clip = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.28}
    base = {"loss_mode": "k1", "use_policy_gradient": True, "loss_agg_mode": "token-mean", "loss_max_clamp": None}
    cases.append(make_case(rng, "estimator", {**base, **CLIP, **clip, "wide": True}))
    cases.append(make_case(rng, "estimator", {**base, **CLIP, "on_policy": True}))
    for agg in ("token-mean", "seq-mean-token-mean"):
        for clamp in (None, -8.0):
            cases.append(make_case(rng, "forward_kl_topk", topk_settings(agg, clamp)))
    if token_sum:
        for mode in ESTIMATOR_MODES:
            for pg in (True, False):
                if not pg and mode == "k1":
                    continue
                cases.append(make_case(rng, "estimator", estimator_settings(rng, mode, pg, "token-sum")))
        cases.append(make_case(rng, "forward_kl_topk", topk_settings("token-sum", -8.0)))
    if token_sum:  # verl >= 0.9: kl backpropagated directly (accepted by every release)
        for agg in AGG_MODES:
            cases.append(make_case(rng, "estimator", estimator_settings(rng, "kl", False, agg)))
    if chunked:
        for chunk, agg, clamp, extra in (
            (1, "token-mean", None, {}),
            (4, "seq-mean-token-mean", -8.0, {}),
            (7, "token-sum" if token_sum else "token-mean", None, {"loss_max_clamp": 1.0}),
            (7, "seq-mean-token-sum-norm", -8.0, {"V": 37, "topk": 6}),
        ):
            settings = topk_settings(agg, clamp, use_chunked_topk=True, chunked_topk_chunk_size=chunk)
            cases.append(make_case(rng, "forward_kl_topk", {**settings, **extra}))
    return cases


# --------------------------------------------------------------------------------------------------
# Configurations verl refuses or warns about
# --------------------------------------------------------------------------------------------------


def _message(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"


def probe(entry: dict) -> tuple[str, str | None]:
    """('refused' | 'warned' | 'accepted', verl's message) for one probe configuration."""
    if "verl_overrides" in entry:
        return probe_teacher_temperature(entry["verl_overrides"][TEMPERATURE_KEY])
    settings = {**entry}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            actor_config(settings.pop("loss_agg_mode", "token-mean"), 4)
            config = loss_config(settings)
    except (ValueError, NotImplementedError, TypeError) as exc:
        return "refused", _message(exc)
    if settings.get("use_chunked_topk"):  # verl does not check the chunk size: run the loss once
        try:
            fsdp_losses.compute_forward_kl_topk(
                student_logits=torch.randn(1, 3, 5),
                teacher_topk_log_probs=torch.nested.as_nested_tensor([torch.zeros(3, 2)], layout=torch.jagged),
                teacher_topk_ids=torch.nested.as_nested_tensor(
                    [torch.zeros(3, 2, dtype=torch.long)], layout=torch.jagged
                ),
                config=config,
                data_format="thd",
            )
        except (ValueError, RuntimeError) as exc:
            return "refused", _message(exc) + " (at the first update; DistillationLossConfig does not check it)"
    printed = out.getvalue().strip()
    if printed:
        return "warned", printed.splitlines()[0][:160]
    return "accepted", None


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def probe_teacher_temperature(temperature: float) -> tuple[str, str | None]:
    """The teacher manager's sampling parameters for a teacher configured at `temperature`."""
    from verl.experimental.teacher_loop import teacher_manager
    from verl.workers.config import DistillationTeacherModelConfig, RolloutConfig

    teacher = DistillationTeacherModelConfig(inference=RolloutConfig(temperature=temperature))
    records = _Records()
    logging.getLogger().addHandler(records)
    try:
        params = teacher_manager._get_teacher_sampling_params(teacher, DistillationLossConfig(loss_mode="k1"))
    except (ValueError, NotImplementedError) as exc:
        return "refused", _message(exc) + " (at start-up)"
    finally:
        logging.getLogger().removeHandler(records)
    if records.messages or params.get("temperature") != temperature:
        note = records.messages[0] if records.messages else f"runs at temperature {params.get('temperature')}"
        return "warned", note[:160]
    return "accepted", None


def configurations() -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {"refused": [], "warned": []}
    for entry, changed in PROBES:
        answer, message = probe(entry)
        if answer == "accepted":
            continue
        record = {**entry, "verl": message}
        if changed is not None:
            record["export_only"] = changed
        found[answer].append(record)
    return found


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def golden(version: str) -> dict:
    torch.manual_seed(SEED)
    rng = torch.Generator().manual_seed(SEED)
    cases = grid(rng, has_token_sum(), has_chunked_topk())
    functions = (
        "trainer/distillation/losses.distillation_loss (core_algos.kl_penalty, compute_policy_loss_vanilla, "
        "agg_loss); trainer/distillation/fsdp/losses.compute_forward_kl_topk"
    )
    return {
        "source": f"verl v{version} (PyPI): {functions}",
        "verl_version": version,
        "made_by": "scripts/make_opd_loss_goldens.py",
        "dtype": "float64",
        "seed": SEED,
        "cases": cases,
        **configurations(),
    }


def _max_rel_diff(expected_value, got) -> float:
    """max |got - expected| / max(max |expected|, tiny) over a value (number or nested list)."""
    exp = torch.as_tensor(expected_value, dtype=torch.float64)
    got = torch.as_tensor(got, dtype=torch.float64)
    if exp.shape != got.shape:
        return math.inf
    if exp.numel() == 0:
        return 0.0
    scale = max(float(exp.abs().max()), 1e-300)
    return float((got - exp).abs().max()) / scale


def replay(path: Path) -> int:
    """Recompute every case of `path` from its inputs with the installed verl; print the differences."""
    data = json.loads(path.read_text())
    worst = {}
    for i, case in enumerate(data["cases"]):
        got = expected(case)
        for name, exp in case["expected"].items():
            if name == "metrics":
                for key, exp_val in exp.items():
                    diff = _max_rel_diff(exp_val, got["metrics"][key]) if key in got["metrics"] else math.inf
                    worst[(case["kind"], f"metric {key}")] = max(worst.get((case["kind"], f"metric {key}"), 0.0), diff)
                    if diff > 1e-6:
                        print(f"case {i}: metric {key}: expected {exp_val!r} got {got['metrics'].get(key)!r}")
            else:
                diff = _max_rel_diff(exp, got[name])
                worst[(case["kind"], name)] = max(worst.get((case["kind"], name), 0.0), diff)
                if diff > 1e-6:
                    print(f"case {i}: {name}: relative difference {diff:.3g}")
    for kind in sorted({kind for kind, _ in worst}):
        items = {name: diff for (k, name), diff in worst.items() if k == kind}
        print(f"{kind}: max relative difference {max(items.values()):.3g}")
        for name, diff in sorted(items.items()):
            print(f"  {name}: {diff:.3g}")
    answers = configurations()
    for kind in ("refused", "warned"):
        ours = [{k: v for k, v in e.items() if k not in ("verl", "export_only")} for e in answers[kind]]
        for entry in data.get(kind, []):
            config = {k: v for k, v in entry.items() if k not in ("verl", "export_only")}
            print(f"{kind} {config}: {'same' if config in ours else 'NOT ' + kind + ' by this verl'}")
    print(f"replayed {len(data['cases'])} cases of {path} with verl {verl.__version__}")
    overall = max(worst.values(), default=0.0)
    print(f"max relative difference: {overall:.3g}")
    return 0 if overall <= 1e-6 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="output file (default tests/data/verl-<version>-opd-loss.json)")
    parser.add_argument("--replay", metavar="FILE", help="recompute FILE's cases from their inputs and compare")
    args = parser.parse_args(argv)
    if args.replay:
        return replay(Path(args.replay))
    version = verl.__version__
    out = Path(args.out) if args.out else ROOT / "tests" / "data" / f"verl-{version}-opd-loss.json"
    if out.resolve() == SHARED_COPY.resolve():
        print(f"{out} is the shared 0.8.0 file's copy, not this script's: give another OUT", file=sys.stderr)
        return 2
    data = golden(version)
    out.write_text(json.dumps(data) + "\n")
    print(
        f"wrote {len(data['cases'])} cases, {len(data['refused'])} refused and {len(data['warned'])} warned "
        f"configurations (verl {version}) to {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
