"""Rollout role (verl: `generate_sequences`): the student samples responses.

A decode loop of our own over the Hugging Face model, lean on purpose (see docs/bench.md for the
measurements that shaped it):

- eval mode under `torch.inference_mode` (no autograd, and gradient checkpointing, which is only
  active in train mode, stays off), a KV cache: HF's DynamicCache, or with
  `hardware.rollout_static_cache` a preallocated StaticCache reused across rollouts;
- one prefill through the model's own mask construction (left padding), then per step one
  decoder call of one token per row with a boolean (b, 1, 1, kv) mask cut from one preallocated
  (b, P + R) mask — no per-step mask rebuild, no per-step concatenation;
- peft's LoRA bookkeeping skipped per call (same arithmetic), and on CPUs where it is the faster
  GEMM shape the few-row linears (lm_head included) computed as W @ x^T (`hardware.rollout_cpu_gemv`);
- on CPUs with bf16 instructions, the dense copies of the 4-bit weights reordered once per rollout
  for oneDNN (bitwise the same products, `hardware.rollout_cpu_prepack`) and the float32 lm_head
  read from a float16 copy of the same values (`hardware.rollout_cpu_fp16_lm_head`);
- the lm_head on the last hidden state only, then sampling and the sampled token's log-prob from
  one exp pass over the (b, V) float32 logits; the full logits are never kept;
- rows stop at any EOS id (the tokenizer's and the generation config's: Qwen3 ends on
  `<|im_end|>` and `<|endoftext|>`); later tokens are padding, masked out; the loop ends when
  every row has;
- the distribution is cut to the tokenizer's ids (`tokenizer_vocab`): output rows past it are
  padding and are never sampled (see logprobs.py; teacher and actor cut the same rows);
- with `hardware.rollout_compile` (CUDA; implies the static cache) the per-step decoder call is
  compiled with `torch.compile(mode="reduce-overhead")`, i.e. replayed as a CUDA graph.

Sampling: sampling.py; the decode fast paths: lean_decode.py.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache

from miniverl.config.actor import RolloutConfig
from miniverl.models.loading import decoder_of
from miniverl.protocol import Batch, assemble, left_pad, pad_right, positions_of
from miniverl.workers.rollout.cpu_products import Float16Head
from miniverl.workers.rollout.lean_decode import (
    LeanDecode,
    by_bf16_instructions,
    few_row_gemv_enabled,
    full_attention_only,
    layer_by_layer,
    lean_decode_modules,
)
from miniverl.workers.rollout.sampling import draw_uniforms, sample_token

STATIC_WIDTH_MULTIPLE = 128  # a static cache holds prompt + response rounded up to this


def cache_keyword(decoder: torch.nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache`; use whichever this version takes."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


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
        cpu_gemv: bool | None = None,
        dequantize_4bit_once: bool = True,
        float32_gemm: bool = False,
        cpu_prepack: bool | None = None,
        cpu_fp16_lm_head: bool | None = None,
    ):
        self.model = model  # the student (LoRA active); shared with the actor
        self.config = config
        self.pad_id, self.device = pad_id, device
        self.eos_ids = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)  # (E,)
        self.tokenizer_vocab = tokenizer_vocab  # None: every output row is a token
        self.cache_kw = cache_keyword(decoder_of(model))
        self.direct_mask = full_attention_only(model)
        self.compile_decode = compile_decode and self.direct_mask
        self.static_cache = static_cache or self.compile_decode
        self.cpu_gemv = few_row_gemv_enabled(cpu_gemv)
        self.dequantize_4bit_once = dequantize_4bit_once  # CPU only: see lean_decode_modules
        self.float32_gemm = float32_gemm  # CPU only: see cpu_gemm
        self.cpu_prepack = by_bf16_instructions(cpu_prepack)  # CPU, native bf16 products only
        # CPU only: the lm_head's float16 copy, kept across rollouts (Float16Head)
        self.fp16_head = Float16Head() if by_bf16_instructions(cpu_fp16_lm_head) else None
        self.last_decode: LeanDecode | None = None  # what the last decode's fast paths held and did
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
                # each decode step's rows; not under torch.compile, which would trace the shared products
                reorder_rows=ids.shape[0] if self.cpu_prepack and cpu and not self.compile_decode else None,
                fp16_head=self.fp16_head if cpu else None,
            ) as lean,
        ):
            tokens, alive, log_probs, steps = self._decode_inference(ids, mask, u, limit)
        self.last_decode = lean
        # Plain (non-inference) tensors: the actor's autograd graph reads the responses.
        alive = alive[:, :steps].clone()
        return tokens[:, :steps].clone(), alive.long(), log_probs[:, :steps].clone() * alive

    def _decode_inference(self, ids: torch.Tensor, mask: torch.Tensor, u: torch.Tensor, limit: int):
        temperature, top_k, top_p = self.config.temperature, self.config.top_k, self.config.top_p
        decoder, lm_head = decoder_of(self.model), self.model.get_output_embeddings()
        b, prompt_width = ids.shape
        width = prompt_width + limit
        if self.static_cache:  # a few fixed widths, so that compiled steps see few shapes
            width = -(-width // STATIC_WIDTH_MULTIPLE) * STATIC_WIDTH_MULTIPLE
        attend = torch.zeros((b, width), dtype=torch.bool, device=self.device)  # (b, P + R) preallocated mask
        attend[:, :prompt_width] = mask.bool()
        cache = self._cache(b, width)
        positions = positions_of(mask)  # (b, P)
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
