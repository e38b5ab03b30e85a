"""The decode step's products on the CPU, prepared when a physical batch starts decoding
(docs/bench.md measures each):

- on CPUs with bf16 instructions, reordered copies (`hardware.rollout_cpu_prepack`): the dense
  bf16 copies of the 4-bit weights are reordered into oneDNN's blocked layout for the decode
  step's rows, so that no product reorders its weight again on every call; layers that read the
  same input (q/k/v, gate/up) are stacked into one product, each taking its slice. Both are
  checked bitwise against the per-layer F.linear on entry, layer by layer, and not used where
  they differ;
- on CPUs with bf16 instructions (and where set on any x86 CPU: fbgemm), the lm_head's float16
  copy (`hardware.rollout_cpu_fp16_lm_head`, Float16Head).
"""

from __future__ import annotations

import warnings
import weakref

import torch

from miniverl.models import cpu_gemm

# Attribute names of the layers of one block that read the same input, in the order stacked.
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _linear_pointwise(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _probe(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(0)).to(dtype)


def _reordered(weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """`weight` (out, in) reordered for products of `rows` rows, or None where oneDNN's ops are
    missing or, on a probe, the product is not bitwise F.linear's."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        probe = _probe(rows, weight.shape[1], weight.dtype)
        same = torch.equal(_linear_pointwise(probe, packed, bias), torch.nn.functional.linear(probe, weight, bias))
    except (AttributeError, NotImplementedError, RuntimeError):  # a torch without oneDNN's ops
        return None
    return packed if same else None


class _Product:
    """One reordered product for the decode step's rows, shared by the layers of `members` (one
    layer, or layers stacked on their input), each taking its slice of the output. The last
    input and its outputs are kept until every member has taken its slice. A member called with
    the very tensor the product was computed from takes the stored slice: Llama/Qwen attention and
    MLP hand one untouched tensor to q/k/v and to gate/up, and holding it keeps its id unique."""

    def __init__(self, members: list[torch.nn.Module], packed: torch.Tensor, bias: torch.Tensor | None):
        self.members, self.packed, self.bias = members, packed, bias
        self.widths = [m.out_features for m in members]
        self.x, self.parts, self.taken = None, (), 0

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self.x or self.taken == len(self.members):
            out = _linear_pointwise(x.to(self.members[0].compute_dtype), self.packed, self.bias)
            self.x, self.parts, self.taken = x, out.split(self.widths, -1), 0
        part = self.parts[index]
        self.taken += 1
        if self.taken == len(self.members):
            self.x, self.parts = None, ()  # the outputs are the callers' now
        return part.to(x.dtype)

    def forward_of(self, index: int, rows: int):
        """Linear4bit.forward of member `index`: the shared product for `rows` rows; any other row
        count (the prompt's prefill) dequantizes per call, as bitsandbytes does."""
        module = self.members[index]
        compute_dtype, bias = module.compute_dtype, cpu_gemm.compute_bias(module)

        def forward(x: torch.Tensor) -> torch.Tensor:
            if x.numel() // x.shape[-1] == rows:
                return self.output(index, x)
            weight = cpu_gemm.dequantized_weight(module)
            return torch.nn.functional.linear(x.to(compute_dtype), weight, bias).to(x.dtype)

        return forward


def _stacked(members: list[torch.nn.Module], rows: int) -> _Product | None:
    """One product for layers that read the same input, where bitwise each layer's own."""
    weights = [cpu_gemm.dequantized_weight(m) for m in members]
    biases = [cpu_gemm.compute_bias(m) for m in members]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    bias = None if biases[0] is None else torch.cat(biases)
    packed = _reordered(torch.cat(weights), bias, rows)
    if packed is None:
        return None
    probe = _probe(rows, weights[0].shape[1], weights[0].dtype)
    parts = _linear_pointwise(probe, packed, bias).split([m.out_features for m in members], -1)
    if not all(torch.equal(p, torch.nn.functional.linear(probe, w, b)) for p, w, b in zip(parts, weights, biases)):
        return None
    return _Product(members, packed, bias)


def reordered_forwards(model: torch.nn.Module, rows: int, eligible) -> tuple[dict, int]:
    """{4-bit layer: its decode forward} for the `eligible(module)` layers of `model` whose
    reordered products are bitwise theirs (stacked where they share an input), and the bytes of
    the reordered copies."""
    forwards, held = {}, 0
    for block in model.modules():
        for names in SHARED_INPUT_GROUPS:
            layers = [getattr(block, n, None) for n in names]
            members = [getattr(m, "base_layer", m) for m in layers]  # under a LoRA wrapper: its base layer
            if (
                any(m is None or not eligible(m) for m in members)
                or len({(m.in_features, m.compute_dtype) for m in members}) > 1
            ):
                continue
            product = _stacked(members, rows)
            if product is not None:
                forwards.update({m: product.forward_of(i, rows) for i, m in enumerate(members)})
                held += product.packed.numel() * product.packed.element_size()
    for module in model.modules():
        if module in forwards or not eligible(module):
            continue
        weight = cpu_gemm.dequantized_weight(module)
        packed = _reordered(weight, cpu_gemm.compute_bias(module), rows)
        if packed is not None:
            forwards[module] = _Product([module], packed, cpu_gemm.compute_bias(module)).forward_of(0, rows)
            held += packed.numel() * packed.element_size()
    return forwards, held


FP16_NORMAL_MIN = 2.0**-14  # the smallest float16 normal


# The most of a head's values that may lie outside the float16 copy (its `residual`). The sparse
# product's cost is mostly its pass over the head's rows: at 4 rows, one thread, an AMX Xeon, 0.7-1.6
# ms for the 14,638 values of a 151,936 x 576 head, 2.4 ms for 1 % of them (875k), against the
# copy's ~23 ms and float32's ~58 ms a step. Beyond 1 %, the values are not a bf16 checkpoint's.
RESIDUAL_MAX_FRACTION = 0.01
# fbgemm's packed float16 matrix pads each row to a multiple of this many values (measured by RSS:
# a 576-wide row takes 1,024 x 2 bytes, 0.89 of its float32 bytes; half at multiples of 512).
FBGEMM_ROW_MULTIPLE = 512
PACK_ROWS = 16384  # rows of a head with a residual packed at once (38 MB of float32 at 576 wide)


class Float16Head:
    """The rollout's lm_head on the CPU (`hardware.rollout_cpu_fp16_lm_head`): a frozen float32
    output layer holding a bf16 checkpoint's values (upcast by `prepare_model_for_kbit_training`)
    is read from a float16 copy packed for fbgemm, which multiplies in float32
    (`quantized::linear_dynamic_fp16`; 2.5x / 1.7x faster than F.linear at one / two threads, 4
    rows of a 151,936 x 576 head, measured): the same values, another summation order (log-probs
    within 2e-5 nats of F.linear's, measured). bf16 reaches below float16's normals: such values
    (0.017 % of the 151,936 x 576 bf16 embedding of `python -m miniverl.real_models
    --cross-tokenizer`, none of SmolLM2's) are zero in the copy and multiplied from a sparse
    float32 residual, added after; a head with more than RESIDUAL_MAX_FRACTION of them (a float32
    checkpoint's), or any inf or NaN, reads its own weight. Packing takes ~0.6 s for a 49,152-token
    vocabulary, so the copy is kept across rollouts while the weight is unchanged (its bytes,
    fbgemm's padding and the residual's included: `held_bytes`)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._weight = lambda: None  # a weak reference: the key's tensor, not another at its address
        self._packed = None
        self.held_bytes = 0

    def forward_for(self, module: torch.nn.Module):
        """A forward for `module` reading the float16 copy, or None where it does not apply."""
        weight, bias = module.weight, module.bias
        if (
            type(module) is not torch.nn.Linear
            or weight.dtype != torch.float32
            or weight.device.type != "cpu"
            or weight.requires_grad
            or (bias is not None and bias.requires_grad)
        ):
            return None
        key = (weight.data_ptr(), weight._version, None if bias is None else (bias.data_ptr(), bias._version))
        if key != self._key or self._weight() is not weight:
            self._key, self._weight = key, weakref.ref(weight)
            self._packed = self._pack(weight.detach(), None if bias is None else bias.detach())
            self.held_bytes = 0
            if self._packed is not None:
                residual = self._packed[1]
                self.held_bytes = float16_copy_bytes(*weight.shape) + (
                    0 if residual is None else _sparse_bytes(residual)
                )
        if self._packed is None:
            return None
        (packs, residual), plain = self._packed, type(module).forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            if x.dtype != torch.float32:  # fbgemm multiplies float32 inputs only
                return plain(module, x)
            return _product(x, packs, residual)

        return forward

    @staticmethod
    def _pack(weight: torch.Tensor, bias: torch.Tensor | None):
        """(fbgemm's packed float16 copies, one per PACK_ROWS rows where there is a residual, the
        sparse residual or None), or None where the head's values are not a bf16 checkpoint's (too
        many outside float16's normals), where one is inf or NaN, or where there is no fbgemm."""
        # Read a block of rows at a time, so that the check adds little to the first rollout's peak.
        outside, budget = [], RESIDUAL_MAX_FRACTION * weight.numel()
        for start in range(0, weight.shape[0], 4096):
            block = weight[start : start + 4096]
            if not bool(block.isfinite().all()):
                return None  # F.linear's inf and NaN (fbgemm would saturate an inf to 65504, in place)
            outside.append((~_in_copy(block)).nonzero() + torch.tensor([start, 0]))
            budget -= len(outside[-1])
            if budget < 0:
                return None  # a float32 checkpoint's values: float16 would round most of them
        at = torch.cat(outside)  # (nnz, 2) row-major: the residual's positions, in CSR order
        residual = None
        if len(at):  # each value in one of them: the copy holds it, or the residual does
            rows, columns = at.unbind(1)
            with warnings.catch_warnings():  # torch's "sparse support is in beta" (the product is checked below)
                warnings.simplefilter("ignore", UserWarning)
                residual = torch.sparse_coo_tensor(at.T, weight[rows, columns], weight.shape, check_invariants=True)
                residual = residual.to_sparse_csr()
        try:
            # Packed a block of rows at a time where values are left out: a block's copy with them
            # zeroed is all it holds in float32 (the whole head's would add its size to the peak).
            packs = (
                tuple(_packed_without(weight, bias, start, at) for start in range(0, weight.shape[0], PACK_ROWS))
                if residual is not None
                else (torch.ops.quantized.linear_prepack_fp16(weight, bias),)
            )
            probe = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0))
            got = _product(probe, packs, residual)
        except (AttributeError, NotImplementedError, RuntimeError):  # no fbgemm (a CPU other than x86)
            return None
        want = torch.cat([torch.nn.functional.linear(probe.double(), b.double()) for b in weight.split(4096)], -1)
        want = want if bias is None else want + bias.double()
        # A guard against a kernel that computes something else, not a bound on its rounding (~1e-6).
        same = bool(((got.double() - want).abs() <= 1e-4 * (want.abs().max() + 1)).all())
        return (packs, residual) if same else None


def _in_copy(values: torch.Tensor) -> torch.Tensor:
    """Where the float16 copy holds the value: exactly, as a normal or zero. The rest goes to the
    residual: values float16 would round or overflow, and its subnormals, which are float32 normals
    there (no flush-to-zero mode, torch.set_flush_denormal, can change them)."""
    return (values.half().float() == values) & ((values == 0) | (values.abs() >= FP16_NORMAL_MIN))


def _packed_without(weight: torch.Tensor, bias: torch.Tensor | None, start: int, at: torch.Tensor):
    """fbgemm's float16 copy of rows start:start + PACK_ROWS of `weight`, the values at `at` (the
    residual's, (nnz, 2)) zeroed."""
    block = weight[start : start + PACK_ROWS].clone()  # (n, H)
    inside = (at[:, 0] >= start) & (at[:, 0] < start + len(block))
    block[at[inside, 0] - start, at[inside, 1]] = 0.0
    return torch.ops.quantized.linear_prepack_fp16(block, None if bias is None else bias[start : start + len(block)])


def _product(x: torch.Tensor, packs: tuple, residual: torch.Tensor | None) -> torch.Tensor:
    outs = [torch.ops.quantized.linear_dynamic_fp16(x, packed) for packed in packs]  # (..., V) in blocks
    out = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
    if residual is not None:  # the values the copy holds as 0: (V, H) sparse @ (H, rows), added after
        rows = x.reshape(-1, x.shape[-1])
        out.view(-1, out.shape[-1]).add_((residual @ rows.T).T)
    return out


def float16_copy_bytes(rows: int, width: int) -> int:
    """The bytes of fbgemm's float16 copy of a (rows, width) weight, its rows padded."""
    return rows * -(-width // FBGEMM_ROW_MULTIPLE) * FBGEMM_ROW_MULTIPLE * 2


def _sparse_bytes(csr: torch.Tensor) -> int:
    parts = (csr.values(), csr.col_indices(), csr.crow_indices())
    return sum(t.numel() * t.element_size() for t in parts)
