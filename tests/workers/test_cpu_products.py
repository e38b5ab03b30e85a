"""cpu_products: the decode step's reordered products are bitwise each 4-bit layer's own (stacked
where layers share their input, per call for any other row count), and the lm_head's float16 copy
holds the same values (those it cannot hold in a sparse residual), and is used only for a bf16
checkpoint's head."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch

from miniverl.models.loading import disable_cpu_nf4_repack
from miniverl.utils.device import cpu_bf16_instructions
from miniverl.workers.rollout import cpu_products
from miniverl.workers.rollout.lean_decode import lean_decode_modules

HIDDEN, INNER, ROWS = 64, 96, 4
REORDERS = cpu_products._reordered(torch.zeros(8, 8, dtype=torch.bfloat16), None, ROWS) is not None
needs_fbgemm = pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines,
    reason="torch has no fbgemm on this CPU (not x86): the lm_head stays float32",
)
needs_reorder = pytest.mark.skipif(
    not REORDERS, reason="oneDNN cannot reorder bf16 weights on this CPU (AVX2): the decode keeps plain dense copies"
)


def nf4(out_features: int, in_features: int, seed: int, bias: bool = False) -> bnb.nn.Linear4bit:
    torch.manual_seed(seed)
    dense = torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    layer = bnb.nn.Linear4bit(
        in_features, out_features, bias=bias, compute_dtype=torch.bfloat16, quant_type="nf4", quant_storage=torch.uint8
    )
    layer.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, quant_type="nf4")
    if bias:
        layer.bias = torch.nn.Parameter(dense.bias.data, requires_grad=False)
    layer = layer.to("cpu")  # quantizes
    disable_cpu_nf4_repack(layer)  # as miniverl loads every NF4 layer
    layer.compute_type_is_set = True  # as after the layer's first call
    return layer


class Block(torch.nn.Module):
    """The 4-bit layers of one decoder block, named as Llama/Qwen name them."""

    def __init__(self, bias: bool = False):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (
            nf4(HIDDEN, HIDDEN, 1, bias),
            nf4(32, HIDDEN, 2, bias),
            nf4(32, HIDDEN, 3, bias),
        )
        self.o_proj = nf4(HIDDEN, HIDDEN, 4)
        self.gate_proj, self.up_proj, self.down_proj = (
            nf4(INNER, HIDDEN, 5),
            nf4(INNER, HIDDEN, 6),
            nf4(HIDDEN, INNER, 7),
        )

    def outputs(self, x: torch.Tensor, x_inner: torch.Tensor) -> list[torch.Tensor]:
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")
        return [getattr(self, n)(x) for n in names] + [self.down_proj(x_inner)]


def count_products(monkeypatch) -> list:
    """The weight shapes of every reordered product computed from now on, in order."""
    shapes, product = [], cpu_products._linear_pointwise

    def counting(x, packed, bias):
        shapes.append(packed.shape)
        return product(x, packed, bias)

    monkeypatch.setattr(cpu_products, "_linear_pointwise", counting)
    return shapes


def test_a_cpu_with_bf16_instructions_reorders_its_bf16_weights():
    if cpu_bf16_instructions() is None:
        pytest.skip("no bf16 instructions here: the decode multiplies in float32 and reorders nothing")
    assert REORDERS


@needs_reorder
@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-qkv-bias"])
@pytest.mark.parametrize("rows", [ROWS, 3 * ROWS], ids=["decode-step", "prefill"])
def test_reordered_products_are_bitwise_each_layers_own(monkeypatch, bias, rows):
    block = Block(bias)
    x = torch.randn(rows, 1, HIDDEN).bfloat16()
    x_inner = torch.randn(rows, 1, INNER).bfloat16()
    with torch.inference_mode():
        per_call = block.outputs(x, x_inner)
        with lean_decode_modules(block, few_row_gemv=False, dequantize_4bit=True, reorder_rows=ROWS) as lean:
            products = count_products(monkeypatch)  # from here: the probes on entry are not counted
            reordered = block.outputs(x, x_inner)
    assert lean.reordered_layers == lean.dequantized_layers == 7
    assert lean.dequantized_bytes == sum(m.out_features * m.in_features * 2 for m in block.children())
    assert all(torch.equal(a, b) for a, b in zip(reordered, per_call))
    if rows == ROWS:  # q/k/v in one product, gate/up in one, o and down alone
        assert products == [(HIDDEN + 64, HIDDEN), (HIDDEN, HIDDEN), (2 * INNER, HIDDEN), (HIDDEN, INNER)]
    else:  # the prefill's rows: each layer dequantizes per call, as bitsandbytes does
        assert products == []
    assert not any("forward" in vars(m) for m in block.modules())


@needs_reorder
def test_a_layer_called_with_another_input_than_its_siblings_gets_its_own_product():
    block = Block()
    x, other = torch.randn(ROWS, 1, HIDDEN).bfloat16(), torch.randn(ROWS, 1, HIDDEN).bfloat16()
    with torch.inference_mode():
        want = [block.q_proj(x), block.k_proj(other), block.v_proj(x)]
        with lean_decode_modules(block, few_row_gemv=False, dequantize_4bit=True, reorder_rows=ROWS):
            got = [block.q_proj(x), block.k_proj(other), block.v_proj(x)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_without_reordering_the_decode_keeps_its_plain_dense_copies():
    block = Block()
    x, x_inner = torch.randn(ROWS, 1, HIDDEN).bfloat16(), torch.randn(ROWS, 1, INNER).bfloat16()
    with torch.inference_mode():
        want = block.outputs(x, x_inner)
        with lean_decode_modules(block, few_row_gemv=False, dequantize_4bit=True, reorder_rows=None) as lean:
            got = block.outputs(x, x_inner)
        with lean_decode_modules(block, False, dequantize_4bit=True, float32_gemm=True, reorder_rows=ROWS) as f32:
            pass
    assert lean.reordered_layers == 0 and lean.dequantized_layers == 7
    assert f32.reordered_layers == 0  # float32 products (cpu_gemm) are never reordered
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ------------------------------------------------------------------------------------ the float16 head
def exact_head(vocab: int = 512, hidden: int = HIDDEN, seed: int = 0) -> torch.nn.Linear:
    """A frozen float32 head holding bf16 values that are float16 normals, as a bf16 checkpoint's
    lm_head after prepare_model_for_kbit_training."""
    torch.manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        weight = head.weight.bfloat16().float()
        weight[weight.abs() < cpu_products.FP16_NORMAL_MIN] = 0.0
        head.weight.copy_(weight)
    head.weight.requires_grad_(False)
    return head


@needs_fbgemm
def test_the_float16_head_multiplies_the_same_values_in_float32():
    head, cache = exact_head(), cpu_products.Float16Head()
    forward = cache.forward_for(head)
    # fbgemm pads each row to 512 values: HIDDEN's 64 take 512 (RSS-measured on 576-wide rows: 1,024)
    assert forward is not None and cache.held_bytes == head.out_features * 512 * 2
    x = torch.randn(ROWS, HIDDEN)
    want = torch.nn.functional.linear(x.double(), head.weight.double())
    got = forward(x)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-5  # float32 rounding, another summation order
    packed = cache._packed
    cache.forward_for(head)
    assert cache._packed is packed  # kept across rollouts while the weight is unchanged
    with torch.no_grad():
        head.weight.mul_(2.0)  # still exact: a new version of the weight is packed again
    twice = cache.forward_for(head)(x)
    assert cache._packed is not packed and (twice.double() - 2 * want).abs().max() < 2e-5


@needs_fbgemm
@pytest.mark.parametrize("pack_rows", [cpu_products.PACK_ROWS, 100])  # the head's 512 rows packed at once, in 6 blocks
def test_values_the_float16_copy_cannot_hold_are_multiplied_from_a_residual_of_the_same_values(pack_rows, monkeypatch):
    monkeypatch.setattr(cpu_products, "PACK_ROWS", pack_rows)
    head = exact_head()
    # Two float16 subnormals, a float32 value, one beyond float16's range.
    outside = {(3, 5): 2.0**-20, (3, 6): 2.0**-15 * 1.5, (7, 0): 0.1 + 2.0**-30, (9, 9): 1e5}
    with torch.no_grad():
        for at, value in outside.items():
            head.weight[at] = value
    cache = cpu_products.Float16Head()
    forward = cache.forward_for(head)
    residual = cache._packed[1]
    assert forward is not None and residual._nnz() == len(outside)
    assert len(cache._packed[0]) == -(-head.out_features // pack_rows)
    assert cache.held_bytes == head.out_features * 512 * 2 + len(outside) * (4 + 8) + (head.out_features + 1) * 8
    x = torch.randn(ROWS, 1, HIDDEN)  # the decode step's (rows, 1, hidden)
    want = torch.nn.functional.linear(x.double(), head.weight.double())
    got = forward(x)
    assert got.shape == (ROWS, 1, head.out_features) and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= 1e-5 * want.abs().clamp(min=1)).all()  # 1e5 x: relative to its row's size
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = forward(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, one_thread)  # the residual's sum per row is one thread's: resumes stay exact


@pytest.mark.parametrize("change", ["float32 values", "an inf", "a NaN", "trainable", "bf16 weights"])
def test_the_float16_head_is_not_used_where_it_would_change_the_weights(change):
    head = exact_head()
    with torch.no_grad():
        if change == "float32 values":  # a float32 checkpoint's head: each value would round
            head.weight.copy_(torch.randn(head.weight.shape))
        elif change in ("an inf", "a NaN"):  # F.linear's inf and NaN; fbgemm's packing would saturate an inf
            head.weight[3, 5] = float("inf") if change == "an inf" else float("nan")
        elif change == "trainable":
            head.weight.requires_grad_(True)
        else:
            head.to(torch.bfloat16)
    before = head.weight.detach().clone()
    cache = cpu_products.Float16Head()
    assert cache.forward_for(head) is None and cache.held_bytes == 0
    assert torch.allclose(head.weight.detach(), before, rtol=0, atol=0, equal_nan=True)  # its own weight untouched


@needs_fbgemm
def test_a_head_with_more_than_its_share_of_values_outside_the_copy_reads_its_own_weight():
    head = exact_head()
    share = int(cpu_products.RESIDUAL_MAX_FRACTION * head.weight.numel())
    flat = head.weight.detach().view(-1)
    with torch.no_grad():
        flat[:share] = 2.0**-20  # as many as the share allows: the copy and its residual
    assert cpu_products.Float16Head().forward_for(head) is not None
    with torch.no_grad():
        flat[share] = 2.0**-20  # one more: the float32 weight
    assert cpu_products.Float16Head().forward_for(head) is None


@needs_fbgemm
def test_the_rollouts_head_reads_the_float16_copy_and_gives_it_back_on_exit():
    head = exact_head()
    model = torch.nn.Module()
    model.lm_head = head
    model.get_output_embeddings = lambda: head
    cache = cpu_products.Float16Head()
    x = torch.randn(ROWS, HIDDEN)
    with torch.inference_mode():
        with lean_decode_modules(model, few_row_gemv=True, fp16_head=cache) as lean:
            patched = "forward" in vars(head)  # before the few-row W @ x^T the float32 head would take
            got = head(x)
        plain = head(x)
    assert patched and lean.fp16_head_bytes == cpu_products.float16_copy_bytes(head.out_features, HIDDEN)
    assert torch.equal(got, cache.forward_for(head)(x)) and (got - plain).abs().max() < 1e-5
    assert "forward" not in vars(head)


@needs_reorder
def test_a_layer_with_someone_elses_forward_is_left_alone_and_its_siblings_multiply_alone(monkeypatch):
    block = Block()
    hooked = block.k_proj.forward  # an instance-level forward, as a hook installs one
    block.k_proj.forward = hooked
    x, x_inner = torch.randn(ROWS, 1, HIDDEN).bfloat16(), torch.randn(ROWS, 1, INNER).bfloat16()
    with torch.inference_mode():
        want = block.outputs(x, x_inner)
        with lean_decode_modules(block, few_row_gemv=False, dequantize_4bit=True, reorder_rows=ROWS) as lean:
            products = count_products(monkeypatch)
            got = block.outputs(x, x_inner)
            still_hooked = vars(block.k_proj)["forward"] is hooked
    assert still_hooked and lean.reordered_layers == lean.dequantized_layers == 6
    # q and v each alone (k is not theirs to compute), o, gate/up stacked, down
    assert products == [(HIDDEN, HIDDEN), (32, HIDDEN), (HIDDEN, HIDDEN), (2 * INNER, HIDDEN), (HIDDEN, INNER)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_fbgemm
def test_the_float16_head_packs_again_for_another_tensor_at_a_freed_ones_address():
    first, second = exact_head(seed=0), exact_head(seed=1)
    cache = cpu_products.Float16Head()
    cache.forward_for(first)
    packed = cache._packed
    # As if `first` were freed and `second` allocated where it was, at the same version count.
    cache._key = (second.weight.data_ptr(), second.weight._version, None)
    x = torch.randn(ROWS, HIDDEN)
    got = cache.forward_for(second)(x)
    assert cache._packed is not packed
    assert (got.double() - torch.nn.functional.linear(x.double(), second.weight.double())).abs().max() < 1e-5
