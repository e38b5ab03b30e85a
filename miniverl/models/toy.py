"""Toy models for runs without downloads: an offline byte-level tokenizer with a Qwen-style chat
template, and small randomly initialised Qwen3 models built from a config block and a seed.

A toy model is written to a folder (safetensors + tokenizer files) and then loaded through the
same `transformers` Auto classes as a hub model, so NF4 quantization and LoRA take the real path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from miniverl.config.model import ToyArchitecture
from miniverl.utils.checkpoint import tensors_with_umask_mode

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen's chat layout; `<|im_end|>` ends every turn and is the EOS token of generation.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's layout, written for the toy: earlier assistant turns keep only their answer (the
# reasoning before `</think>` is dropped), and `enable_thinking=false` pre-fills an empty
# reasoning block after the generation prompt.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)
QWEN3_REGULAR_TOKENS = 151_643  # ids below Qwen3's first added token
QWEN3_VOCAB_ROWS = 151_936  # Qwen3's embedding rows: padded past the tokenizer's 151,669 ids
# Qwen3's 26 added tokens in id order from 151,643, and whether each is special.
QWEN3_ADDED_TOKENS = (
    *(
        (t, True)
        for t in (
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
        )
    ),
    ("<tool_call>", False),
    ("</tool_call>", False),
    *(
        (t, True)
        for t in ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
    ),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)


BPE_VOCAB = 512  # the bpe layout's most ids: 3 special tokens, 256 bytes, the merges its corpus offers (485)
# What the bpe layout's merges are learnt from: the toy prompts' kind of text (numbers, short English).
BPE_CORPUS = [
    f"What is {a} + {b}? Answer briefly. {a} + {b} = {a + b}. The answer is {a + b}."
    for a in range(0, 100, 7)
    for b in range(0, 100, 11)
] + ["Repeat the word exactly: hello world, the sea is blue and the sky is grey, write one sentence."] * 20


def tokenizer_length(layout: str) -> int:
    """len(build_toy_tokenizer(layout)), without building it."""
    if layout == "bpe":
        return len(bpe_toy_tokenizer())
    return QWEN3_REGULAR_TOKENS + len(QWEN3_ADDED_TOKENS) if layout == "qwen3" else 256 + 3


def build_toy_tokenizer(layout: str = "bytes") -> PreTrainedTokenizerFast:
    """An offline byte-level tokenizer: any UTF-8 text round-trips through the 256 byte tokens.

    bytes: + 3 special tokens, vocabulary 259. qwen3: Qwen3's id layout — the byte tokens, filler
    tokens up to id 151,642 (never produced by encoding, but real ids a model can sample), then
    Qwen3's 26 added tokens at their real ids; vocabulary 151,669. bpe: the 3 special tokens, then
    the bytes and merges a byte-level BPE learns from BPE_CORPUS (the same ids on every build).
    """
    if layout == "bpe":
        return bpe_toy_tokenizer()
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    if layout == "qwen3":
        vocab.update({f"<|toy_{i}|>": i for i in range(len(vocab), QWEN3_REGULAR_TOKENS)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    if layout == "qwen3":
        # One call: adding them one at a time rebuilds the added vocabulary each time (seconds).
        backend.add_tokens(
            [AddedToken(token, special=special, normalized=False) for token, special in QWEN3_ADDED_TOKENS]
        )
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=IM_END, pad_token=PAD)
        tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
        return tokenizer
    backend.add_special_tokens([PAD, IM_START, IM_END])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=IM_END, pad_token=PAD)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@functools.cache
def bpe_tokenizer_backend() -> Tokenizer:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[PAD, IM_START, IM_END],
        show_progress=False,
    )
    backend.train_from_iterator(BPE_CORPUS, trainer)
    return backend


def bpe_toy_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer.from_str(bpe_tokenizer_backend().to_str())  # a copy: a caller may add tokens
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=IM_END, pad_token=PAD)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def toy_qwen3_config(arch: ToyArchitecture, tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=arch.vocab_rows or len(tokenizer),
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.kv_heads,
        head_dim=arch.attention_head_dim,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype=arch.dtype,
    )


def stop_token_ids(arch: ToyArchitecture, tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The generation config's EOS ids: Qwen3's ends on `<|im_end|>` and `<|endoftext|>`."""
    if arch.tokenizer == "qwen3":
        return [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)]
    return [tokenizer.eos_token_id]


def build_toy_model(arch: ToyArchitecture, tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen3ForCausalLM:
    """Random weights from `seed`, in float32 (toy pretraining runs in float32; `save_toy`
    writes `arch.dtype`)."""
    config = toy_qwen3_config(arch, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=stop_token_ids(arch, tokenizer), pad_token_id=tokenizer.pad_token_id
    )
    return model.float().eval()


def pretrain_on_corpus(
    model: Qwen3ForCausalLM,
    corpus: Sequence[Sequence[int]],
    *,
    steps: int,
    lr: float,
    seed: int,
    pad_id: int,
    batch_size: int = 16,
) -> list[float]:
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
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def save_toy(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, folder: Path, dtype: str = "float32") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, dtype)).save_pretrained(folder)  # safetensors, config.json, generation_config.json
    tokenizer.save_pretrained(folder)
    tensors_with_umask_mode(folder)
    return folder
