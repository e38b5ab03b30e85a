"""An estimate of a run's peak memory from its config alone (no model loaded): the doctor's
memory check (trainer/preflight.py) compares it with the device's memory."""

from __future__ import annotations

import torch

from miniverl.config import MiniverlConfig
from miniverl.config.model import ALL_LINEAR
from miniverl.models import cpu_gemm
from miniverl.models import loading as models
from miniverl.workers.logprobs import rows_per_chunk
from miniverl.workers.rollout.cpu_products import float16_copy_bytes
from miniverl.workers.rollout.lean_decode import by_bf16_instructions

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LLAMA_LINEAR_LAYERS = 7  # q, k, v, o, gate, up, down: what all-linear adapts in a Llama or Qwen layer


def architecture(where: str, block) -> dict:
    """The sizes the memory estimate needs, the dtype the weights load in (`dtype: auto`: the
    checkpoint's) and the positions the model was trained for (None where its config names none); a
    model that cannot be read is the one line of `where` (`model`, `teacher`)."""
    if block.model_id == "toy":
        t = block.toy
        return dict(
            vocab=t.vocab_rows or models.toy.tokenizer_length(t.tokenizer),
            hidden=t.hidden_size,
            inter=t.intermediate_size,
            layers=t.num_layers,
            heads=t.num_heads,
            kv=t.kv_heads,
            head_dim=t.attention_head_dim,
            tied=t.tie_word_embeddings,
            dtype=t.dtype if block.dtype == "auto" else block.dtype,
            positions=t.max_position_embeddings,
        )
    from transformers import AutoConfig

    source = models.source_of(block, None)
    try:
        c = AutoConfig.from_pretrained(source.path, revision=source.revision, trust_remote_code=block.trust_remote_code)
    except (OSError, ValueError) as error:  # a missing folder, one that is not a model, an uncached hub id
        raise models.offline_error(where, source, error) from None
    text = c.get_text_config()  # of a vision-language checkpoint (Gemma-3 4B and up): its language model's
    hidden, heads = text.hidden_size, text.num_attention_heads  # GPT-2's n_embd and n_head by transformers' names
    # The MLP's width under each family's name (GPT-2 and BLOOM: none, four times the width).
    inter = next(
        (v for n in ("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim") if (v := getattr(text, n, None))),
        4 * hidden,
    )
    if isinstance(inter, (list, tuple)):  # one width a layer (Gemma-3n): their mean, for the sum over layers
        inter = sum(inter) / len(inter)
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0
    per_expert = getattr(text, "moe_intermediate_size", None) or inter  # Mixtral's intermediate_size is per expert
    dtype = getattr(c, "dtype", None) or getattr(text, "dtype", None) or "float32"
    saved = getattr(c, "quantization_config", None) or {}  # a checkpoint saved quantized loads as saved
    saved = saved.to_dict() if hasattr(saved, "to_dict") else saved
    return dict(
        saved_bits=4 if saved.get("load_in_4bit") else 8 if saved.get("load_in_8bit") else None,
        vocab=text.vocab_size,
        hidden=hidden,
        # Every layer's MLP: a dense one, or (MoE) a shared expert beside the routed ones.
        inter=(getattr(text, "shared_expert_intermediate_size", None) or 0) if experts else inter,
        # Routed experts: 3-D parameters, not linear layers: NF4 and LoRA's all-linear leave them as they load.
        expert_weights=text.num_hidden_layers * experts * 3 * hidden * per_expert,
        layers=text.num_hidden_layers,
        heads=heads,
        kv=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or hidden // heads,
        tied=bool(getattr(c, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False))),
        dtype=str(dtype).replace("torch.", "") if block.dtype == "auto" else block.dtype,
        positions=getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None),  # GPT-2's
    )


def weight_bytes(a: dict, quantization: str, other_bytes: int) -> int:
    """Linear layers (NF4: 4 bits and one float32 absmax per 64 weights; a checkpoint saved quantized: its
    4 or 8 bits, whatever the block's `quantization`) + the embedding, and the output layer unless tied,
    in `other_bytes` per value."""
    linear = linear_weights(a)
    embeddings = a["vocab"] * a["hidden"] * (1 if a["tied"] else 2)
    bits = a.get("saved_bits") or (4 if quantization == "nf4" else None)
    per_linear = bits / 8 + 4 / 64 if bits else DTYPE_BYTES.get(a["dtype"], 4)
    experts = a.get("expert_weights", 0) * DTYPE_BYTES.get(a["dtype"], 4)  # as they load, NF4 or not
    return int(linear * per_linear + embeddings * other_bytes + experts)


def linear_weights(a: dict) -> int:
    """The weights of every decoder layer's linear layers (attention and MLP), as weight_bytes counts them."""
    return a["layers"] * (a["hidden"] * a["head_dim"] * (2 * a["heads"] + 2 * a["kv"]) + 3 * a["hidden"] * a["inter"])


def estimate_peak_bytes(cfg: MiniverlConfig, device_type: str = "cpu", heldout_rows: int | None = None) -> int:
    """Weights + KV cache of the rollout (and on the CPU its dense copies of the 4-bit weights and
    the lm_head's float16 copy) + the activations of one update chunk (checkpointed or all) + the
    logits of one log-prob chunk + the held-out probe's full-vocabulary blocks + LoRA weights,
    gradients and AdamW state. An estimate, at the sizes that run: a physical batch or a chunk
    holds at most the rows there are (`heldout_rows`: the probe's prompts; None: unknown, as many as
    the physical batch), a log-prob chunk at most MAX_CHUNK_ELEMENTS logits."""
    s = architecture("model", cfg.model)
    hw, train_rows = cfg.hardware, cfg.recipe.logical_batch * cfg.rollout.n
    probe_rows = (hw.rollout_physical_batch if heldout_rows is None else heldout_rows) if cfg.eval.every != -1 else 0
    rows = min(hw.rollout_physical_batch, max(train_rows, probe_rows))  # (B) of one decode
    chunk, probe_chunk = min(hw.update_chunk, train_rows), min(hw.update_chunk, probe_rows)
    # prepare_model_for_kbit_training casts every unquantized weight of the student to float32:
    # the embedding (tied to the output layer: one copy) and the norms.
    prepared = cfg.model.quantization == "nf4" and cfg.model.prepare_kbit_training
    total = weight_bytes(s, cfg.model.quantization, 4 if prepared else DTYPE_BYTES.get(s["dtype"], 4))
    for name, block in cfg.teacher_blocks.items():  # every teacher is loaded once, for the whole run
        if block.mode == "standard":
            t = architecture(cfg.teacher_where(name), block)
            total += weight_bytes(t, block.quantization, DTYPE_BYTES.get(t["dtype"], 4))
    tokens = cfg.recipe.prompt_limit + cfg.recipe.response_limit
    total += 2 * s["layers"] * rows * tokens * s["kv"] * s["head_dim"] * 4  # KV cache
    layer_activations = 16 * s["hidden"] * 4  # per position, float32
    if cfg.model.gradient_checkpointing:  # every layer's input kept, one layer's activations recomputed at a time
        total += chunk * tokens * (s["layers"] * s["hidden"] * 4 + layer_activations)
    else:  # every layer's activations kept for the backward
        total += chunk * tokens * s["layers"] * layer_activations
    if device_type == "cuda" and hw.deterministic:
        # The math attention backend (utils/device.set_determinism) materialises one layer's (b, heads, L, L)
        # scores in float32, their softmax and its gradient: 2.4 GB per score tensor at 4 x 16 heads x 3072.
        total += 3 * chunk * s["heads"] * tokens**2 * 4
    total += rows_per_chunk(hw.logprob_chunk, s["vocab"]) * s["vocab"] * 4 * 3  # logits, exp, gradient of a chunk
    if device_type == "cpu" and cfg.model.quantization == "nf4" and hw.rollout_dequantize_4bit_once:
        # the rollout's dense copies of the 4-bit weights: float32 where the roles multiply in float32
        float32 = cpu_gemm.enabled_for(hw, torch.device("cpu"))
        total += linear_weights(s) * (4 if float32 else DTYPE_BYTES.get(s["dtype"], 4))
    if device_type == "cpu" and prepared and by_bf16_instructions(hw.rollout_cpu_fp16_lm_head):
        total += float16_copy_bytes(s["vocab"], s["hidden"])  # the float32 lm_head's float16 copy (its values allowing)
    if cfg.eval.every != -1 and s["vocab"] <= cfg.eval.exact_kl_max_vocab:
        # the probe's exact KL: student and teacher log-probs, exp and product, (rows, R, V) float32 each
        total += 4 * probe_chunk * (cfg.eval.response_limit or cfg.recipe.response_limit) * s["vocab"] * 4
    targets = cfg.model.lora.peft_targets()
    adapted = LLAMA_LINEAR_LAYERS if targets == ALL_LINEAR else len(targets)
    lora = 2 * cfg.model.lora.r * s["hidden"] * s["layers"] * adapted
    total += lora * 4 * 4  # weights, gradients, two AdamW moments
    return total
