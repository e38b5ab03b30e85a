"""Rollout role (verl: `generate_sequences`): the student samples responses.

A decode loop of our own over the Hugging Face model, lean on purpose (see docs/bench.md for the
measurements that shaped it):

- eval mode under `torch.inference_mode` (no autograd, and gradient checkpointing, which is only
  active in train mode, stays off), a KV cache: HF's DynamicCache, or with
  `hardware.rollout_static_cache` a preallocated StaticCache reused across rollouts;
- one prefill through the model's own mask construction (left padding), then per step one
  decoder call of one token per row with a boolean (b, 1, 1, kv) mask cut from one preallocated
  (b, P + R) mask — no per-step mask rebuild, no per-step concatenation;
- peft's LoRA bookkeeping skipped per call (same arithmetic), and on the CPU the few-row linears
  (lm_head included) computed as W @ x^T, a faster GEMM shape there (`hardware.rollout_cpu_gemv`);
- the lm_head on the last hidden state only, then sampling and the sampled token's log-prob from
  one exp pass over the (b, V) float32 logits; the full logits are never kept;
- rows stop at any EOS id (the tokenizer's and the generation config's: Qwen3 ends on
  `<|im_end|>` and `<|endoftext|>`); later tokens are padding, masked out; the loop ends when
  every row has;
- the distribution is cut to the tokenizer's ids (`tokenizer_vocab`): output rows past it are
  padding and are never sampled (see logprobs.py; teacher and actor cut the same rows);
- with `hardware.rollout_compile` (CUDA; implies the static cache) the per-step decoder call is
  compiled with `torch.compile(mode="reduce-overhead")`, i.e. replayed as a CUDA graph.

Sampling streams. Each sample has its own stream, a CPU `torch.Generator` seeded from the plan,
from which it draws exactly one uniform number u_t (float64, [0, 1)) per response position — all
`response_limit` of them at the start of its rollout. Step t picks, by inverse CDF, the first
token whose cumulative (filtered) probability exceeds u_t: the tokens a sample gets depend only
on its seed and its own logits, never on which other samples share its physical batch, and the
draw is the same on every device. The cumulative sum is taken in fixed point (int64 units of
2^-52 of the row's mass): exact, and deterministic on CUDA too, which has no deterministic
floating-point cumsum (`torch.use_deterministic_algorithms` refuses one).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache

from miniverl.config.actor import RolloutConfig
from miniverl.models import cpu_gemm
from miniverl.protocol import Batch

STATIC_WIDTH_MULTIPLE = 128  # a static cache holds prompt + response rounded up to this


def cache_keyword(decoder: torch.nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache`; use whichever this version takes."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids, mask), both (B, P), left-padded to the longest prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


FIXED_POINT_ONE = 2**52  # a row's whole probability mass, in integer units


def fixed_point_units(weights: torch.Tensor) -> torch.Tensor:
    """(b, V) non-negative weights -> (b, V) int64 shares of FIXED_POINT_ONE (rounded down),
    whose integer cumsum is exact and deterministic on every device. A token below 2^-52 of the
    mass gets 0."""
    total = weights.sum(-1, keepdim=True, dtype=torch.float64)
    return (weights.double() * (FIXED_POINT_ONE / total)).long()


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """verl/vLLM-style top-k then top-p filtering of (B, V) logits (-inf outside the kept set)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        units = fixed_point_units(sorted_logits.softmax(-1))
        before = units.cumsum(-1) - units  # the mass ahead of each token
        drop = before > round(top_p * FIXED_POINT_ONE)  # keep the first token that crosses top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def draw_uniforms(seeds: list[int], steps: int, device: torch.device) -> torch.Tensor:
    """(b, steps) float64 in [0, 1): row i is the first `steps` numbers of sample i's own stream."""
    rows = [torch.rand(steps, generator=torch.Generator().manual_seed(int(s)), dtype=torch.float64) for s in seeds]
    return torch.stack(rows).to(device)


def sample_token(
    logits: torch.Tensor, u: torch.Tensor, *, top_k: int = -1, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling from (b, V) float32 logits (already divided by the temperature).

    u (b,) float64 in [0, 1). Returns the tokens (b,) long and their log-probs (b,) float32 under
    the unfiltered distribution: logits[token] - logsumexp(logits), the actor's formula.
    """
    top = logits.amax(-1, keepdim=True)  # (b, 1)
    weights = (logits - top).exp_()  # (b, V): the one exp pass
    log_z = top.squeeze(-1) + weights.sum(-1).log()  # (b,) logsumexp
    if (0 < top_k < logits.shape[-1]) or top_p < 1.0:
        # The kept set always holds the argmax, so `top` stays the right shift.
        weights = (filter_logits(logits, top_k, top_p) - top).exp_()
    cdf = fixed_point_units(weights).cumsum(-1)  # (b, V) int64
    total = cdf[:, -1:]
    # x < total strictly, so the first cdf entry above x is a token of non-zero weight.
    x = torch.minimum((u[:, None] * total).long(), total - 1)
    # (The clamp only matters for non-finite logits, whose NaN log-prob the actor then refuses.)
    token = torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(0, logits.shape[-1] - 1)  # (b,)
    log_prob = logits.gather(-1, token[:, None]).squeeze(-1) - log_z
    return token, log_prob


GEMV_MAX_ROWS = 8  # up to this many rows, W @ x^T beats F.linear's x @ W^T on the CPUs measured


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
    as cpu_gemm's, like every other role's."""
    compute_dtype = module.compute_dtype
    bias = None if module.bias is None else module.bias.to(compute_dtype)  # frozen while decoding

    def forward(x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.linear(x.to(compute_dtype), weight, bias, float32_gemm=float32_gemm).to(x.dtype)

    return forward


@dataclass
class LeanDecode:
    """What `lean_decode_modules` did: modules given a lean forward, and the bytes of the dense
    copies of 4-bit weights it held while decoding (freed on exit)."""

    patched: int = 0
    dequantized_layers: int = 0
    dequantized_bytes: int = 0


@contextmanager
def lean_decode_modules(
    model: torch.nn.Module, few_row_gemv: bool, dequantize_4bit: bool = False, float32_gemm: bool = False
):
    """While decoding: plain LoRA layers skip peft's per-call bookkeeping (same arithmetic), and
    with `few_row_gemv` (the CPU) every plain float32 nn.Linear (the LoRA matrices and the lm_head
    included) computes up to GEMV_MAX_ROWS rows as W @ x^T, a GEMM shape MKL runs 1.5-4x faster
    than F.linear's x @ W^T for 2-8 rows (measured, docs/bench.md); the values differ from
    F.linear's only in float rounding.

    bitsandbytes 4-bit layers on the CPU (`dequantize_4bit`, `hardware.rollout_dequantize_4bit_once`;
    bitsandbytes' CPU path dequantizes the whole weight on every call, i.e. every token): each
    weight is dequantized once on entry, and the layer multiplies with that dense copy (the values
    bitsandbytes' own CPU path dequantizes on every call, bitwise; with `float32_gemm` multiplied as
    cpu_gemm does, else in the compute dtype); the copies are freed on exit, their bytes reported in
    the yielded LeanDecode. Every other frozen half-precision layer multiplies as cpu_gemm's
    `float32_products` says. Everything is restored on exit."""
    state, patched = LeanDecode(), []
    for module in model.modules():
        if "forward" in vars(module):  # someone else's instance-level forward (hooks): leave it
            continue
        if _plain_lora(module):
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
        elif dequantize_4bit and cpu_gemm.plain_cpu_4bit(module) and module.compute_type_is_set:
            weight = cpu_gemm.dequantized_weight(module)
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


def full_attention_only(model: PreTrainedModel) -> bool:
    """Whether every layer is plain causal attention under SDPA, so a boolean (b, 1, 1, kv) mask
    may be handed to the decoder directly."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types_ = getattr(config, "layer_types", None)
    implementation = getattr(config, "_attn_implementation", None)
    return implementation == "sdpa" and types_ is not None and set(types_) == {"full_attention"}


# Decoders whose forward is exactly embed -> rotary -> layers -> norm (transformers 5), so a decode
# step may call their layers directly.
LAYER_BY_LAYER_MODEL_TYPES = ("qwen3", "qwen2", "llama")


def layer_by_layer(decoder: torch.nn.Module) -> bool:
    return getattr(decoder.config, "model_type", None) in LAYER_BY_LAYER_MODEL_TYPES and all(
        hasattr(decoder, name) for name in ("embed_tokens", "rotary_emb", "layers", "norm")
    )


class RolloutWorker:
    def __init__(
        self,
        model: PreTrainedModel,
        config: RolloutConfig,
        *,
        eos_ids: Sequence[int],
        pad_id: int,
        device: torch.device,
        tokenizer_vocab: int | None = None,
        static_cache: bool = False,
        compile_decode: bool = False,
        cpu_gemv: bool = True,
        dequantize_4bit_once: bool = True,
        float32_gemm: bool = False,
    ):
        self.model = model  # the student (LoRA active); shared with the actor
        self.config = config
        self.pad_id, self.device = pad_id, device
        self.eos_ids = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)  # (E,)
        self.tokenizer_vocab = tokenizer_vocab  # None: every output row is a token
        self.cache_kw = cache_keyword(model.get_decoder())
        self.direct_mask = full_attention_only(model)
        self.compile_decode = compile_decode and self.direct_mask
        self.static_cache = static_cache or self.compile_decode
        self.cpu_gemv = cpu_gemv
        self.dequantize_4bit_once = dequantize_4bit_once  # CPU only: see lean_decode_modules
        self.float32_gemm = float32_gemm  # CPU only: see cpu_gemm
        self.dequantized_bytes = 0  # the 4-bit weights' dense copies during the last decode (freed after)
        self._static_caches: dict[tuple[int, int], StaticCache] = {}
        self._compiled_step = None
        # A device sync per step costs a CUDA pipeline stall; check for "all rows done" less often there.
        self.check_every = 1 if device.type == "cpu" else 8

    @torch.no_grad()
    def generate_sequences(
        self,
        prompts: list[list[int]],
        prompt_rows: list[int],
        seeds: list[int],
        *,
        response_limit: int,
        physical_batches: list[int],
    ) -> Batch:
        """Sample one response per prompt; `physical_batches` are the row counts of each forward."""
        self.model.eval()
        ids, mask = left_pad(prompts, self.pad_id, self.device)  # (B, P)
        parts, start = [], 0
        for size in physical_batches:
            rows = slice(start, start + size)
            parts.append(self._decode(ids[rows], mask[rows], seeds[rows], response_limit))
            start += size
        width = max(1, max(int(m.sum(-1).max()) for _, m, _ in parts))  # longest response of the batch
        responses = torch.cat([pad_right(r, width, self.pad_id) for r, _, _ in parts])  # (B, R)
        response_mask = torch.cat([pad_right(m, width, 0) for _, m, _ in parts]).float()
        log_probs = torch.cat([pad_right(lp, width, 0.0) for _, _, lp in parts])
        return assemble(
            ids,
            mask,
            responses,
            response_mask,
            log_probs,
            torch.tensor(prompt_rows, dtype=torch.long, device=self.device),
        )

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor, seeds: list[int], limit: int):
        """One physical batch: returns responses (b, R'), response mask (b, R'), log-probs (b, R')."""
        u = draw_uniforms(seeds, limit, self.device)  # (b, limit)
        cpu = self.device.type == "cpu"
        with (
            torch.inference_mode(),
            lean_decode_modules(
                self.model,
                self.cpu_gemv and cpu,
                dequantize_4bit=self.dequantize_4bit_once and cpu,
                float32_gemm=self.float32_gemm and cpu,
            ) as lean,
        ):
            tokens, alive, log_probs, steps = self._decode_inference(ids, mask, u, limit)
        self.dequantized_bytes = lean.dequantized_bytes  # dense copies of 4-bit weights held while decoding
        # Plain (non-inference) tensors: the actor's autograd graph reads the responses.
        alive = alive[:, :steps].clone()
        return tokens[:, :steps].clone(), alive.long(), log_probs[:, :steps].clone() * alive

    def _decode_inference(self, ids: torch.Tensor, mask: torch.Tensor, u: torch.Tensor, limit: int):
        temperature, top_k, top_p = self.config.temperature, self.config.top_k, self.config.top_p
        decoder, lm_head = self.model.get_decoder(), self.model.get_output_embeddings()
        b, prompt_width = ids.shape
        width = prompt_width + limit
        if self.static_cache:  # a few fixed widths, so that compiled steps see few shapes
            width = -(-width // STATIC_WIDTH_MULTIPLE) * STATIC_WIDTH_MULTIPLE
        attend = torch.zeros((b, width), dtype=torch.bool, device=self.device)  # (b, P + R) preallocated mask
        attend[:, :prompt_width] = mask.bool()
        cache = self._cache(b, width)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (b, P)
        # Prefill through the model's own mask construction (it handles the left padding); a static
        # cache is as wide as the whole sequence, so its 2-D mask is too.
        prefill_mask = attend.long() if self.static_cache else mask
        hidden = decoder(
            input_ids=ids, attention_mask=prefill_mask, position_ids=positions, use_cache=True, **{self.cache_kw: cache}
        ).last_hidden_state[:, -1]  # (b, H)
        position = positions[:, -1:] + 1  # (b, 1)
        tokens = torch.full((b, limit), self.pad_id, dtype=torch.long, device=self.device)
        log_probs = torch.zeros((b, limit), dtype=torch.float32, device=self.device)
        alive = torch.zeros((b, limit), dtype=torch.bool, device=self.device)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        step_fn = self._step_function(decoder)
        steps = limit
        for step in range(limit):
            logits = lm_head(hidden)[:, : self.tokenizer_vocab].float()  # (b, V): padding rows cut
            if temperature != 1.0:
                logits = logits / temperature
            token, log_prob = sample_token(logits, u[:, step], top_k=top_k, top_p=top_p)
            token = token.masked_fill(done, self.pad_id)
            tokens[:, step] = token
            log_probs[:, step] = log_prob
            alive[:, step] = ~done
            done = done | torch.isin(token, self.eos_ids)
            if step == limit - 1 or ((step + 1) % self.check_every == 0 and bool(done.all())):
                steps = step + 1
                break
            attend[:, prompt_width + step] = True
            kv = width if self.static_cache else prompt_width + step + 1
            hidden = step_fn(token[:, None], position, attend, kv, cache)
            position = position + 1
        return tokens, alive, log_probs, steps

    def _cache(self, b: int, width: int):
        if not self.static_cache:
            return DynamicCache(config=self.model.config)
        cache = self._static_caches.pop((b, width), None)
        if cache is None:  # kept per shape: a compiled step keeps seeing the same buffers
            cache = StaticCache(config=self.model.config, max_cache_len=width)
        else:
            cache.reset()
        self._static_caches[(b, width)] = cache  # most recently used last
        while len(self._static_caches) > 2:
            del self._static_caches[next(iter(self._static_caches))]
        return cache

    def _step_function(self, decoder):
        """(token (b, 1), position (b, 1), attend (b, W) bool, kv, cache) -> last hidden state (b, H)."""
        kw = self.cache_kw

        layered = self.direct_mask and layer_by_layer(decoder)

        def plain(token, position, attend, kv, cache):
            if layered:  # the decoder's own forward, minus its per-call bookkeeping
                mask = attend[:, None, None, :kv]
                hidden = decoder.embed_tokens(token)
                embeddings = decoder.rotary_emb(hidden, position)
                for layer in decoder.layers[: decoder.config.num_hidden_layers]:
                    hidden = layer(
                        hidden,
                        attention_mask=mask,
                        position_ids=position,
                        use_cache=True,
                        position_embeddings=embeddings,
                        **{kw: cache},
                    )
                return decoder.norm(hidden)[:, -1]
            if self.direct_mask:
                mask = {"full_attention": attend[:, None, None, :kv]}
            else:
                mask = attend[:, :kv].long()
            return decoder(
                input_ids=token, attention_mask=mask, position_ids=position, use_cache=True, **{kw: cache}
            ).last_hidden_state[:, -1]

        if not self.compile_decode:
            return plain
        if self._compiled_step is None:
            mode = "reduce-overhead" if self.device.type == "cuda" else "default"
            self._compiled_step = torch.compile(plain, mode=mode, dynamic=False)
        compiled = self._compiled_step

        def step(token, position, attend, kv, cache):
            # The output lives in the CUDA graph's memory, which the next replay overwrites.
            return compiled(token, position, attend, kv, cache).clone()

        return step


def pad_right(x: torch.Tensor, width: int, value) -> torch.Tensor:
    if x.shape[1] >= width:
        return x[:, :width]
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def assemble(prompts, prompt_mask, responses, response_mask, rollout_log_probs, prompt_rows) -> Batch:
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)  # (B, L)
    return Batch(
        prompt_rows=prompt_rows,
        prompts=prompts,
        responses=responses,
        input_ids=torch.cat([prompts, responses], dim=1),
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        response_mask=response_mask,
        rollout_log_probs=rollout_log_probs,
    )
