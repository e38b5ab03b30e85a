"""Toy models for runs without downloads: an offline byte-level tokenizer with a Qwen-style chat
template, and small randomly initialised Qwen3 models built from a config block and a seed.

A toy model is written to a folder (safetensors + tokenizer files) and then loaded through the
same `transformers` Auto classes as a hub model, so NF4 quantization and LoRA take the real path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from miniverl.schema.model import ToyArchitecture

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen's chat layout; `<|im_end|>` ends every turn and is the EOS token of generation.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_toy_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens (any UTF-8 text round-trips) + 3 special tokens; vocabulary 259."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([PAD, IM_START, IM_END])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=IM_END, pad_token=PAD)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def toy_qwen3_config(arch: ToyArchitecture, tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_heads,
        head_dim=arch.hidden_size // arch.num_heads,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )


def build_toy_model(arch: ToyArchitecture, tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen3ForCausalLM:
    config = toy_qwen3_config(arch, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model.float().eval()


def pretrain_on_corpus(model: Qwen3ForCausalLM, corpus: Sequence[Sequence[int]], *, steps: int, lr: float,
                       seed: int, pad_id: int, batch_size: int = 16) -> list[float]:
    """Next-token training of the full toy model on a token corpus (deterministic; CPU is fine).

    Returns the loss of each step. Used to give the toy teacher a distribution worth distilling.
    """
    if steps == 0 or not corpus:
        return []
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        rows = torch.randint(len(corpus), (min(batch_size, len(corpus)),), generator=generator).tolist()
        width = max(len(corpus[r]) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T), right-padded
        for i, r in enumerate(rows):
            ids[i, : len(corpus[r])] = torch.tensor(corpus[r])
        mask = ids.ne(pad_id).long()
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    model.eval()
    return losses


def save_toy(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)  # safetensors
    tokenizer.save_pretrained(folder)
    return folder
