"""cpu_gemm: frozen half-precision CPU layers multiply their own bf16 operands in float32, forward
and backward, and the models are untouched outside the context."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch

from miniverl.config.hardware import HardwareConfig
from miniverl.models import cpu_gemm
from miniverl.models.loading import disable_cpu_nf4_repack
from miniverl.utils.device import cpu_bf16_instructions
from miniverl.workers.rollout.lean_decode import lean_decode_modules

BF16_ULP = 2.0**-8  # relative spacing of bfloat16 values: one rounding step


def nf4_layer(seed: int = 0) -> bnb.nn.Linear4bit:
    torch.manual_seed(seed)
    dense = torch.nn.Linear(96, 64, bias=True).to(torch.bfloat16)
    layer = bnb.nn.Linear4bit(
        96, 64, bias=True, compute_dtype=torch.bfloat16, quant_type="nf4", quant_storage=torch.uint8
    )
    layer.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, quant_type="nf4")
    layer.bias = torch.nn.Parameter(dense.bias.data, requires_grad=False)
    layer = layer.to("cpu")  # quantizes
    # As miniverl loads every NF4 layer: on a CPU with AVX512-BF16, bitsandbytes would otherwise
    # repack the weight for its inference kernel on the first no-grad call (models/loading.py).
    disable_cpu_nf4_repack(layer)
    return layer


def test_a_loaded_nf4_layer_stays_on_the_dequantize_path_on_every_cpu():
    layer = nf4_layer()
    assert cpu_gemm.plain_cpu_4bit(layer)
    with torch.no_grad():
        layer.eval()(torch.randn(2, 96))  # the call that would repack on an AVX512-BF16 CPU
    assert cpu_gemm.plain_cpu_4bit(layer) and not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)


@pytest.mark.parametrize(
    "found,float32,gemv", [(None, True, True), ("avx512_bf16", False, True), ("amx", False, False)]
)
def test_the_products_and_the_decode_gemv_are_chosen_by_the_cpu_unless_set(monkeypatch, found, float32, gemv):
    from miniverl.workers.rollout import lean_decode

    monkeypatch.setattr(cpu_gemm, "cpu_bf16_instructions", lambda: found)
    monkeypatch.setattr(lean_decode, "cpu_bf16_instructions", lambda: found)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert cpu_gemm.enabled_for(HardwareConfig(), cpu) is float32
    assert lean_decode.few_row_gemv_enabled(None) is gemv and lean_decode.few_row_gemv_enabled(True) is True
    assert cpu_gemm.product_name(float32, cpu) == (
        "float32 GEMM of bf16 operands" if float32 else f"native bf16 GEMM ({found})"
    )
    assert cpu_gemm.enabled_for(HardwareConfig(cpu_float32_gemm=True), cpu) is True
    assert cpu_gemm.enabled_for(HardwareConfig(cpu_float32_gemm=False), cpu) is False
    assert cpu_gemm.enabled_for(HardwareConfig(cpu_float32_gemm=True), cuda) is False


def test_the_products_named_are_those_of_the_weights_the_roles_compute_with():
    import bitsandbytes as bnb

    cpu, float32 = torch.device("cpu"), torch.nn.Linear(4, 4)
    assert cpu_gemm.half_dtypes([float32]) == set()
    assert cpu_gemm.product_name(False, cpu, set()) == "float32 GEMM (no half-precision weights)"
    assert cpu_gemm.half_dtypes([float32, torch.nn.Linear(4, 4).to(torch.float16)]) == {torch.float16}
    nf4 = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.bfloat16)  # 4-bit weights: their compute dtype counts
    assert cpu_gemm.half_dtypes([nf4]) == {torch.bfloat16}
    assert (
        cpu_gemm.product_name(True, cpu, {torch.bfloat16, torch.float16}) == "float32 GEMM of bf16 and float16 operands"
    )
    assert cpu_gemm.product_name(True, torch.device("cuda"), set()) == "float32 GEMM (no half-precision weights)"


@pytest.mark.skipif(
    cpu_bf16_instructions() is None, reason="this CPU has no bf16 instructions (AVX2): float32 products"
)
def test_a_cpu_with_bf16_instructions_multiplies_natively_by_default():
    assert not cpu_gemm.enabled_for(HardwareConfig(), torch.device("cpu"))
    assert cpu_gemm.product_name(False, torch.device("cpu")).startswith("native bf16 GEMM (")


@pytest.mark.skipif(cpu_bf16_instructions() is not None, reason="this CPU has bf16 instructions: native products")
def test_a_cpu_without_bf16_instructions_multiplies_in_float32_by_default():
    assert cpu_gemm.enabled_for(HardwareConfig(), torch.device("cpu"))


def model_of(layer: torch.nn.Module) -> torch.nn.Module:
    return torch.nn.Sequential(layer)


def test_an_nf4_layer_multiplies_its_bf16_operands_in_float32_forward_and_backward():
    layer = nf4_layer()
    x = torch.randn(5, 96, dtype=torch.float32, requires_grad=True)  # float32 in: prepare_model_for_kbit_training
    stock = layer(x)
    with cpu_gemm.float32_products(model_of(layer), enabled=True) as switched:
        assert switched == 1
        ours = layer(x)
        grad = torch.randn_like(ours)
        (grad_ours,) = torch.autograd.grad(ours, x, grad)
    weight = cpu_gemm.dequantized_weight(layer).float()  # (64, 96), the values bitsandbytes multiplies
    expected = (x.detach().bfloat16().float() @ weight.T + layer.bias.float()).bfloat16().float()
    assert torch.equal(ours.detach(), expected)
    assert ours.dtype == stock.dtype == torch.float32
    # bitsandbytes' own bf16 product: the same values up to the float32 accumulation order.
    assert float(((ours - stock).detach().abs() / stock.abs().clamp_min(1e-2)).max()) <= 2 * BF16_ULP
    assert torch.equal(grad_ours, (grad.bfloat16().float() @ weight).bfloat16().float())
    assert "forward" not in vars(layer)  # restored on exit


def test_frozen_bf16_linears_switch_and_trainable_or_float32_ones_do_not():
    frozen = torch.nn.Linear(32, 16, bias=False).to(torch.bfloat16).requires_grad_(False)
    trainable = torch.nn.Linear(32, 16).to(torch.bfloat16)
    full = torch.nn.Linear(32, 16).requires_grad_(False)
    x = torch.randn(3, 32).bfloat16()
    with cpu_gemm.float32_products(torch.nn.ModuleList([frozen, trainable, full]), enabled=True) as switched:
        assert switched == 1 and "forward" in vars(frozen)
        assert torch.equal(frozen(x), (x.float() @ frozen.weight.float().T).bfloat16())
    with cpu_gemm.float32_products(frozen, enabled=False) as switched:
        assert switched == 0 and "forward" not in vars(frozen)


def test_a_backward_after_the_context_still_multiplies_in_float32_and_keeps_no_float32_weight():
    layer = nf4_layer(1)
    x = torch.randn(4, 96, dtype=torch.bfloat16, requires_grad=True)
    with cpu_gemm.float32_products(model_of(layer), enabled=True):
        y = layer(x)  # (4, 64)
    assert type(y.grad_fn).__name__ == "_Float32ProductBackward"
    assert y.grad_fn.saved_tensors == ()  # the weight is dequantized again in backward, not kept
    y.sum().backward()
    weight = cpu_gemm.dequantized_weight(layer).float()
    assert torch.equal(x.grad, (torch.ones(4, 64) @ weight).bfloat16())


@pytest.mark.parametrize("float32_gemm", [True, False])
def test_the_rollouts_dense_copies_multiply_as_the_per_call_layer_does(float32_gemm):
    layer = nf4_layer(2)
    x = torch.randn(3, 96)
    with torch.inference_mode():
        with cpu_gemm.float32_products(model_of(layer), enabled=float32_gemm):
            per_call = layer(x)
        with lean_decode_modules(
            model_of(layer), few_row_gemv=False, dequantize_4bit=True, float32_gemm=float32_gemm
        ) as lean:
            once = layer(x)
    assert lean.dequantized_layers == 1
    # With float32 products the copy is held in float32: converted once, not at every token.
    assert lean.dequantized_bytes == 64 * 96 * (4 if float32_gemm else 2)
    assert torch.equal(once, per_call)
