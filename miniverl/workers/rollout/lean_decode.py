"""The rollout's fast paths while decoding: peft's LoRA bookkeeping skipped (same arithmetic), few-row
CPU linears as W @ x^T, NF4 weights dequantized once per rollout (and reordered once for oneDNN),
the float32 lm_head read from a float16 copy of its values (and a residual of the few it cannot
hold), and what the model must be for the decode step to call its layers directly (docs/bench.md
measures each)."""

from __future__ import annotations

import types
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from miniverl.models import cpu_gemm
from miniverl.utils.device import cpu_bf16_instructions
from miniverl.workers.rollout import cpu_products

GEMV_MAX_ROWS = 8  # up to this many rows, W @ x^T beats F.linear's x @ W^T on the CPUs measured


def few_row_gemv_enabled(setting: bool | None) -> bool:
    """`hardware.rollout_cpu_gemv`; null: by the CPU. W @ x^T was measured faster on an AVX2 EPYC
    (MKL, 1.5-4x) and slower on an AMX Xeon (oneDNN, 1.3-3x at SmolLM2's shapes): off with AMX."""
    return setting if setting is not None else cpu_bf16_instructions() != "amx"


def by_bf16_instructions(setting: bool | None) -> bool:
    """`hardware.rollout_cpu_prepack` / `rollout_cpu_fp16_lm_head`; null: where the CPU has bf16
    instructions (AMX or AVX512-BF16), the CPUs whose decode steps read bf16 weights natively."""
    return setting if setting is not None else cpu_bf16_instructions() is not None


def resolved_decode_settings(hardware) -> dict[str, bool]:
    """The decode's CPU settings of a HardwareConfig as this CPU resolves their nulls (the plan and
    the bench record these)."""
    return {
        "rollout_cpu_gemv": few_row_gemv_enabled(hardware.rollout_cpu_gemv),
        "rollout_cpu_prepack": by_bf16_instructions(hardware.rollout_cpu_prepack) and not hardware.rollout_compile,
        "rollout_cpu_fp16_lm_head": by_bf16_instructions(hardware.rollout_cpu_fp16_lm_head),
    }


def _few_row_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward, computed as (W @ x^T)^T when x has at most GEMV_MAX_ROWS rows."""
    rows = x.numel() // x.shape[-1]
    if rows > GEMV_MAX_ROWS or x.dtype != self.weight.dtype:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    out = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).T).T
    out = out + self.bias if self.bias is not None else out.contiguous()
    return out.reshape(*x.shape[:-1], self.out_features)


def _lean_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's LoRA Linear forward for its plain case (one adapter, no dropout, no variant, not
    merged), the same operations in the same order, without its per-call bookkeeping."""
    if args or kwargs:
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    dtype = result.dtype
    name = self.active_adapters[0]
    lora_a, lora_b = self.lora_A[name], self.lora_B[name]
    if self.cast_input_dtype_enabled and x.dtype != lora_a.weight.dtype:
        x = x.to(lora_a.weight.dtype)
    return (result + lora_b(lora_a(x)) * self.scaling[name]).to(dtype)


def _plain_lora(module: torch.nn.Module) -> bool:
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:
        return False
    if type(module) is not LoraLinear or module.merged or module.disable_adapters:
        return False
    active = list(module.active_adapters)
    return (
        len(active) == 1
        and active[0] in module.lora_A
        and active[0] not in module.lora_variant
        and isinstance(module.lora_dropout[active[0]], torch.nn.Identity)
        and hasattr(module, "cast_input_dtype_enabled")
    )


def _lean_lora4bit_forward(module: torch.nn.Module):
    """peft's LoRA forward over a bitsandbytes 4-bit base (`peft.tuners.lora.bnb.Linear4bit`) for
    its plain case, the same operations in the same order (the input cast to the adapter's dtype,
    lora_B(lora_A(x)) * scaling cast to the base output's dtype, then added), without its per-call
    bookkeeping: the adapter's weights are read once, when decoding starts (they do not change
    while it runs), and its two matrices are applied with F.linear, as their nn.Linear does."""
    name = module.active_adapters[0]
    lora_a, lora_b, scaling = module.lora_A[name], module.lora_B[name], module.scaling[name]
    a_weight, a_bias, b_weight, b_bias = lora_a.weight, lora_a.bias, lora_b.weight, lora_b.bias
    cast = module.cast_input_dtype_enabled
    base, linear, plain_forward = module.base_layer, torch.nn.functional.linear, type(module).forward

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or torch.is_autocast_enabled():
            return plain_forward(module, x, *args, **kwargs)
        result = base(x)
        if cast and x.dtype != a_weight.dtype:
            x = x.to(a_weight.dtype)
        return result + (linear(linear(x, a_weight, a_bias), b_weight, b_bias) * scaling).to(result.dtype)

    return forward


def _plain_lora_4bit(module: torch.nn.Module) -> bool:
    try:
        from peft.tuners.lora.bnb import Linear4bit as Lora4bit
    except ImportError:  # peft without bitsandbytes
        return False
    if type(module) is not Lora4bit or module.merged or module.disable_adapters:
        return False
    active = list(module.active_adapters)
    name = active[0] if len(active) == 1 else None
    return (
        name in module.lora_A
        and name not in module.lora_variant
        and isinstance(module.lora_dropout[name], torch.nn.Identity)
        and type(module.lora_A[name]) is torch.nn.Linear
        and type(module.lora_B[name]) is torch.nn.Linear
        and not any(
            vars(m).get("forward") or m._forward_hooks or m._forward_pre_hooks
            for m in (module.lora_A[name], module.lora_B[name])
        )
        and hasattr(module, "cast_input_dtype_enabled")
    )


def _dense_4bit_forward(module: torch.nn.Module, weight: torch.Tensor, float32_gemm: bool):
    """Linear4bit.forward with its dequantized weight (bitsandbytes 0.50's CPU path: Linear4bit.forward
    -> matmul_4bit -> gemm_4bit's default kernel) without the per-call dequantization; the product
    as cpu_gemm's, like every other role's (with `float32_gemm` the weight is held in float32)."""
    compute_dtype, bias = module.compute_dtype, cpu_gemm.compute_bias(module)  # frozen while decoding

    def forward(x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.linear(x.to(compute_dtype), weight, bias, float32_gemm=float32_gemm).to(x.dtype)

    return forward


def _dense_eligible(module: torch.nn.Module) -> bool:
    """A plain CPU 4-bit layer that has picked its compute dtype and has no instance forward of
    someone else's (a hook), which decoding leaves alone."""
    return "forward" not in vars(module) and cpu_gemm.plain_cpu_4bit(module) and module.compute_type_is_set


@dataclass
class LeanDecode:
    """What `lean_decode_modules` did: modules given a lean forward, and the bytes of the dense
    copies of 4-bit weights it held while decoding (freed on exit; `reordered_layers` of them in
    oneDNN's layout), and of the lm_head's float16 copy it read (kept by its Float16Head)."""

    patched: int = 0
    dequantized_layers: int = 0
    dequantized_bytes: int = 0
    reordered_layers: int = 0
    fp16_head_bytes: int = 0


@contextmanager
def lean_decode_modules(
    model: torch.nn.Module,
    few_row_gemv: bool,
    dequantize_4bit: bool = False,
    float32_gemm: bool = False,
    *,
    reorder_rows: int | None = None,
    fp16_head: cpu_products.Float16Head | None = None,
):
    """While decoding: plain LoRA layers skip peft's per-call bookkeeping (same arithmetic), and
    with `few_row_gemv` (the CPU) every plain float32 nn.Linear (the LoRA matrices and the lm_head
    included) computes up to GEMV_MAX_ROWS rows as W @ x^T, a GEMM shape MKL runs 1.5-4x faster
    than F.linear's x @ W^T for 2-8 rows (measured, docs/bench.md); the values differ from
    F.linear's only in float rounding.

    bitsandbytes 4-bit layers on the CPU (`dequantize_4bit`, `hardware.rollout_dequantize_4bit_once`;
    bitsandbytes' CPU path dequantizes the whole weight on every call, i.e. every token): each
    weight is dequantized once on entry, and the layer multiplies with that dense copy (the values
    bitsandbytes' own CPU path dequantizes on every call, bitwise; with `float32_gemm` held in float32
    and multiplied as cpu_gemm does, else held and multiplied in the compute dtype); the copies are
    freed on exit, their bytes reported in the yielded LeanDecode. With `reorder_rows` (native bf16
    products, `hardware.rollout_cpu_prepack`) the copies are reordered for products of that many
    rows, the decode step's, and stacked where layers share their input
    (cpu_products.reordered_forwards). With `fp16_head` the model's output
    layer reads its float16 copy (cpu_products.Float16Head). Every other frozen half-precision
    layer multiplies as cpu_gemm's `float32_products` says. Everything is restored on exit."""
    state, patched = LeanDecode(), []
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    reordered = {}
    if dequantize_4bit and reorder_rows is not None and not float32_gemm:
        reordered, state.dequantized_bytes = cpu_products.reordered_forwards(model, reorder_rows, _dense_eligible)
    for module in model.modules():
        if "forward" in vars(module):  # someone else's instance-level forward (hooks): leave it
            continue
        half_head = fp16_head.forward_for(module) if fp16_head is not None and module is head else None
        if half_head is not None:
            module.forward = half_head
            state.fp16_head_bytes = fp16_head.held_bytes
        elif _plain_lora(module):
            module.forward = types.MethodType(_lean_lora_forward, module)
        elif _plain_lora_4bit(module):
            module.forward = _lean_lora4bit_forward(module)
        elif (
            few_row_gemv
            and type(module) is torch.nn.Linear
            and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu"
        ):
            module.forward = types.MethodType(_few_row_linear, module)
        elif module in reordered:
            module.forward = reordered[module]
            state.dequantized_layers += 1
            state.reordered_layers += 1
        elif dequantize_4bit and _dense_eligible(module):
            weight = cpu_gemm.dequantized_weight(module)
            if float32_gemm and weight.dtype in cpu_gemm.HALF:
                # Converted once here, not at every token: a fresh float32 copy of every weight per
                # decode step took a quarter of the real recipe's rollout as the AVX2 kind runs it.
                weight = weight.float()
            module.forward = _dense_4bit_forward(module, weight, float32_gemm)
            state.dequantized_layers += 1
            state.dequantized_bytes += weight.numel() * weight.element_size()
            del weight
        else:
            continue
        patched.append(module)
    state.patched = len(patched)
    try:
        with cpu_gemm.float32_products(model, float32_gemm):
            yield state
    finally:
        for module in patched:
            del module.forward  # drops the dense copies with the closures that hold them


# Families whose config lists no `layer_types` and whose layers are all plain causal attention.
FULL_ATTENTION_MODEL_TYPES = ("llama",)


def full_attention_only(model: PreTrainedModel) -> bool:
    """Whether every layer is plain causal attention under SDPA, so a boolean (b, 1, 1, kv) mask
    may be handed to the decoder directly."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types_ = getattr(config, "layer_types", None)
    if types_ is None:  # Llama's config has no per-layer types: every layer is full attention
        full = getattr(config, "model_type", None) in FULL_ATTENTION_MODEL_TYPES
    else:
        full = set(types_) == {"full_attention"}
    return getattr(config, "_attn_implementation", None) == "sdpa" and full


# Decoders whose forward is exactly embed -> rotary -> layers -> norm (transformers 5), so a decode
# step may call their layers directly.
LAYER_BY_LAYER_MODEL_TYPES = ("qwen3", "qwen2", "llama")


def layer_by_layer(decoder: torch.nn.Module) -> bool:
    return getattr(decoder.config, "model_type", None) in LAYER_BY_LAYER_MODEL_TYPES and all(
        hasattr(decoder, name) for name in ("embed_tokens", "rotary_emb", "layers", "norm")
    )
