"""Half-precision matrix products on the CPU: the one product every role uses (`hardware.cpu_float32_gemm`).

A bfloat16 product is a float32 accumulation rounded to bfloat16 at the end, whichever kernel
runs it; what differs between CPUs is the speed of torch's bfloat16 GEMM. On CPUs without
bfloat16 instructions (AVX2, and AVX-512 parts without AVX512-BF16 or AMX) it is a slow path:
measured on a 2-core AVX2 EPYC at the bench scale's shapes, x @ W^T takes 7x and grad @ W 40x the
time of a float32 GEMM of the same values. On a CPU with AMX it is the fast path: measured on a
2-core Sapphire Rapids at SmolLM2-135M's shapes, the float32 product of the same bf16 operands
takes 6-7x the time of the native one for 360 rows and 2x for 4 (docs/bench.md). With AVX512-BF16
and no AMX the native one wins few rows and loses full sequences (1.5x): ~4% slower over the real
recipe in one run, kept (scripts/cpu_product_choice.py times both on any CPU). So the product is
chosen by the CPU (`enabled_for`): float32 without bf16 instructions, native with them; one choice
per run, taken by every role. While `float32_products` is active, every frozen half-precision product on
the CPU — bitsandbytes' 4-bit layers (dequantized per call, as bitsandbytes does) and frozen
bf16/fp16 nn.Linear layers such as an NF4 teacher's lm_head — multiplies the same half-precision
operands in float32 and rounds the result to their dtype, forward and backward. The values are
bitsandbytes' own up to the order of the float32 accumulation (1 ulp of bfloat16 in about 0.01%
of the outputs, measured). The rollout, the teacher, the actor, the probe and the doctor use it
alike, so every role computes one and the same distribution.

Outside the context the models are untouched: each role enters it around its own compute.
"""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch

from miniverl.utils.device import cpu_bf16_instructions

HALF = (torch.bfloat16, torch.float16)


def enabled_for(hardware, device: torch.device) -> bool:
    """Whether a run's roles multiply this way: `hardware.cpu_float32_gemm` (a HardwareConfig) on the
    CPU; null: where the CPU has no bfloat16 instructions."""
    if device.type != "cpu":
        return False
    if hardware.cpu_float32_gemm is None:
        return cpu_bf16_instructions() is None
    return hardware.cpu_float32_gemm


def half_dtypes(models) -> set[torch.dtype]:
    """The half-precision dtypes these models compute in: their weights' and their 4-bit layers'
    compute dtype (bitsandbytes' `compute_dtype`)."""
    found = set()
    for model in models:
        found.update(m.compute_dtype for m in model.modules() if getattr(m, "compute_dtype", None) in HALF)
        found.update(p.dtype for p in model.parameters() if p.dtype in HALF)
    return found


def product_name(float32_gemm: bool, device: torch.device, half: set[torch.dtype] = frozenset(HALF[:1])) -> str:
    """The report's name for the products a run's roles computed; `half`: the half-precision dtypes
    they compute in (none: every product is float32's, whatever the setting says)."""
    if not half:
        return "float32 GEMM (no half-precision weights)"
    if device.type != "cpu":
        return f"{device.type}: native half-precision GEMM"
    kinds = " and ".join("bf16" if dtype == torch.bfloat16 else "float16" for dtype in HALF if dtype in half)
    if float32_gemm:
        return f"float32 GEMM of {kinds} operands"
    return f"native {kinds} GEMM ({cpu_bf16_instructions() or 'no bf16 instructions'})"


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, float32_gemm: bool
) -> torch.Tensor:
    """F.linear(x, weight, bias); with `float32_gemm`, half-precision CPU operands multiply in
    float32 and the result is rounded to their dtype (the weight may be held in float32 already:
    the rollout's dense copies)."""
    if float32_gemm and x.device.type == "cpu" and x.dtype in HALF and weight.dtype in (x.dtype, torch.float32):
        return torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


class _Float32Product(torch.autograd.Function):
    """y = round(x @ W^T + b) for a frozen W (and b) given by `weight_of()`, which may dequantize:
    it is called again in backward rather than keeping a float32 copy of W alive for it (as
    bitsandbytes keeps only the packed 4-bit weight)."""

    @staticmethod
    def forward(ctx, x, weight_of, bias):  # x (..., in) half; returns (..., out) in x's dtype
        ctx.weight_of = weight_of
        return linear(x, weight_of(), bias, float32_gemm=True)

    @staticmethod
    def backward(ctx, grad):  # grad (..., out)
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return (grad.float() @ ctx.weight_of().float()).to(grad.dtype), None, None


def plain_cpu_4bit(module: torch.nn.Module) -> bool:
    """A bitsandbytes Linear4bit on the CPU whose forward is exactly `F.linear(x.to(compute_dtype),
    dequantize_4bit(W), bias.to(compute_dtype)).to(x.dtype)` (bitsandbytes 0.50's CPU path): not
    packed for bitsandbytes' AVX512-BF16 kernel, not transposed, and dequantizing to its compute
    dtype."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    if not isinstance(module, bnb.nn.Linear4bit) or module.weight.device.type != "cpu":
        return False
    state = getattr(module.weight, "quant_state", None)
    return (
        state is not None
        and not getattr(state, "packing_format_for_cpu", False)
        and module.compute_dtype is not None
        and not getattr(module, "support_avx512bf16_for_cpu", False)
        and tuple(state.shape) == (module.out_features, module.in_features)
        and state.dtype == module.compute_dtype
    )


def dequantized_weight(module: torch.nn.Module) -> torch.Tensor:
    """The dense weight of a plain CPU Linear4bit, in its compute dtype (what its forward multiplies)."""
    import bitsandbytes as bnb

    return bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)


def compute_bias(module: torch.nn.Module) -> torch.Tensor | None:
    """A Linear4bit's bias in its compute dtype, as its forward adds it."""
    return None if module.bias is None else module.bias.to(module.compute_dtype)


def _float32_4bit_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not self.compute_type_is_set:  # the first call picks it from the input: bitsandbytes' own forward
        return type(self).forward(self, x)
    x_compute = x.to(self.compute_dtype)
    return _Float32Product.apply(x_compute, lambda: dequantized_weight(self), compute_bias(self)).to(x.dtype)


def _float32_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != self.weight.dtype:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    return _Float32Product.apply(x, lambda: self.weight, self.bias)


def _frozen_half_linear(module: torch.nn.Module) -> bool:
    return (
        type(module) is torch.nn.Linear
        and module.weight.dtype in HALF
        and module.weight.device.type == "cpu"
        and not module.weight.requires_grad
        and (module.bias is None or not module.bias.requires_grad)
    )


@contextmanager
def float32_products(model: torch.nn.Module, enabled: bool):
    """While active (and `enabled`), the model's frozen half-precision CPU layers multiply in
    float32 (see the module's docstring); a module that already has an instance-level forward (a
    hook, the rollout's lean decode) is left alone. Yields the number of layers switched."""
    patched = []
    if enabled:
        for module in model.modules():
            if "forward" in vars(module):
                continue
            if plain_cpu_4bit(module):
                module.forward = types.MethodType(_float32_4bit_forward, module)
            elif _frozen_half_linear(module):
                module.forward = types.MethodType(_float32_linear_forward, module)
            else:
                continue
            patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward
