"""The compute precision of a model, and how closely two computations of the same log-prob may
agree in it — the one place the exactness checks (the doctor, the tests) take tolerances from.

Two kernels that compute the same log-prob (the rollout's one-token decode step and the
full-sequence forward of the teacher or the actor) round in different places. In float32 they
agree to ~1e-5. bfloat16 keeps 8 bits of mantissa: one rounding moves a value by up to 2^-9
(0.2%) of itself, so a logit of magnitude 20 moves by 0.04, and a few such roundings per layer
add up — more in a trained model, whose activations have large outliers, than in a random one.
Measured on the real fixture (SmolLM2-135M-Instruct cut to 15 layers, NF4, 4 x 48 sampled tokens,
AMX CPU): the rollout vs a full forward of the same weights differ by 0.032 nats on average and
0.20 at most, with the native or the float32 product alike; the same forward computed in bf16
and in float32 differ by 0.064 and 0.38 — sampling and scoring agree within half of what bf16
compute itself is off by. Over 16 updates of `+recipe=opd_k1_real_cpu` on that cut (profile v3) the
rollout and the actor differed by at most 0.39, and by 0.06 on average in the worst update. A
misaligned position, by contrast, is off by the log-prob itself (several nats) at most positions, and another model
(even a random toy teacher against its random student) by 0.8 or more at some position: hence
0.5 at most (the doctor's self-test saw 0.39 over 192 tokens of the real recipe, where the earlier
0.25 made it FAIL a sound setup) and 0.1 on average. For agreement to 1e-4, compute in float32
(`model.dtype=float32`: NF4 weights with float32 compute).
"""

from __future__ import annotations

import torch

# Largest |log p_a - log p_b| of one token (nats) and the largest mean over tokens.
LOG_PROB_TOLERANCE = {torch.float32: (1e-3, 1e-4), torch.float16: (0.1, 0.01), torch.bfloat16: (0.5, 0.1)}
# Largest relative difference of two LoRA gradients computed along the same arithmetic path, in
# any precision: the NF4 layers and their dequantized twin multiply the same values in the same
# dtype (measured: 0 on the CPU in bfloat16; a float32 twin of a bfloat16 model differs by ~7e-3).
GRADIENT_TOLERANCE = 1e-3
_PRECISION_ORDER = (torch.bfloat16, torch.float16, torch.float32)  # fewest mantissa bits first


def least_precise_dtype(model: torch.nn.Module) -> torch.dtype:
    """The least precise dtype the model computes in: a 4-bit layer's compute dtype, or a
    floating parameter's dtype (the NF4 student keeps float32 embeddings and norms, but its
    matrix products run in the NF4 layers' bfloat16)."""
    seen = {p.dtype for p in model.parameters() if p.dtype.is_floating_point}
    seen |= {m.compute_dtype for m in model.modules() if getattr(m, "compute_dtype", None) is not None}
    return next((d for d in _PRECISION_ORDER if d in seen), torch.float32)


def log_prob_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(largest per-token difference, largest mean difference) in nats."""
    return LOG_PROB_TOLERANCE.get(dtype, LOG_PROB_TOLERANCE[torch.float32])


def agreement(k1: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> tuple[str, str]:
    """PASS, WARN or FAIL, and the line saying why, for two computations of the same log-probs
    (`k1`: their difference at each position, (B, T); `mask`: the positions that count). Over the
    mean tolerance, or over the largest in float32 (whose paths agree to ~1e-5), or over twice the
    largest: a misaligned position or a path that differs. Over only the largest, in bf16 or fp16:
    a few tokens in rounding's tail, as some trained models reach (a 20-layer cut of the real
    fixture: 0.75 at most, 0.017 on average in bf16; 1.5e-4 at most in float32): a WARN."""
    worst_allowed, mean_allowed = log_prob_tolerance(dtype)
    k1 = torch.where(mask.bool(), k1, 0.0)  # padding's -inf - -inf is no disagreement
    mean, worst, tokens = float(k1.sum() / mask.sum().clamp_min(1)), float(k1.abs().max()), int(mask.sum())
    if not torch.isfinite(k1).all():  # a NaN compares False with every tolerance
        return "FAIL", f"{int((~torch.isfinite(k1)).sum())} of {tokens} log-prob differences are not finite"
    over = int((k1.abs() > worst_allowed).sum())
    line = f"k1 mean {mean:.2e}, largest |k1| {worst:.2e} over {tokens} tokens "
    line += f"({str(dtype).replace('torch.', '')} compute: allowed {mean_allowed:g} / {worst_allowed:g})"
    rounding_tail = dtype in (torch.bfloat16, torch.float16)  # float32 paths agree to ~1e-5
    if abs(mean) > mean_allowed or worst > 2 * worst_allowed or (worst > worst_allowed and not rounding_tail):
        return "FAIL", f"{line}: sampling and scoring disagree (alignment or a numerical path differs)"
    if worst > worst_allowed:
        return "WARN", (
            f"{line}: {over} of {tokens} tokens over the largest, the mean within: rounding's tail on some trained "
            "models; to tell it from a path that differs, run again with model.dtype=float32"
        )
    return "PASS", line
