"""Schema of `conf/model/`: the student. Field names are those of the reference report's
`models.student` block."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from miniverl.config.bounds import check_range

QUANTIZATIONS = ("nf4", "none")
# peft's and verl's name for every linear layer but the output layer, whatever the family calls them.
ALL_LINEAR = "all-linear"
DTYPES = ("auto", "float32", "bfloat16", "float16")


def cache_root() -> Path:
    """Where miniverl keeps what it builds once per machine (the real models): $MINIVERL_CACHE, else
    ~/.cache/miniverl. Never inside the repository."""
    return Path(os.environ.get("MINIVERL_CACHE") or Path.home() / ".cache" / "miniverl").expanduser()


def real_model_path(name: str) -> str:
    """The folder of a real model `python -m miniverl.real_models` builds (resolver `real_model`:
    `model_id: ${real_model:smollm2-135m-instruct-every2}` in conf/model/)."""
    return str(cache_root() / "real" / name)


TOY_TOKENIZERS = ("bytes", "qwen3", "bpe")
TOY_DTYPES = ("float32", "bfloat16")


@dataclass
class ToyArchitecture:
    """A randomly initialised Qwen3 built when `model_id: toy`, and its offline tokenizer.

    `tokenizer: bytes` is 256 byte tokens + 3 special ones (259 ids); `tokenizer: qwen3` lays the
    ids out as Qwen3's tokenizer does (151,643 regular ids, bytes first, then Qwen3's 26 added
    tokens at their real ids 151,643..151,668, a chat template with `enable_thinking`, and a
    generation config that ends on `<|im_end|>` and `<|endoftext|>`); `tokenizer: bpe` merges bytes
    into 512 ids (a byte-level BPE trained on a fixed corpus when built, the bytes' special tokens and
    chat template): another tokenization of the same text, for a teacher with another tokenizer
    (`teacher.tokenizer_alignment: text`). `vocab_rows` pads the
    embedding past the tokenizer (Qwen3: 151,936 rows); null: one row per token.
    """

    # Width of the toy model: larger is slower and holds more.
    hidden_size: int = 64
    # Width of the toy's MLP.
    intermediate_size: int = 128
    # Longest sequence the toy accepts: at least prompt_limit + response_limit.
    max_position_embeddings: int = 1024
    # Attention heads (hidden_size must be a multiple, unless head_dim is set).
    num_heads: int = 4
    # Decoder layers of the toy.
    num_layers: int = 2
    num_kv_heads: Optional[int] = None  # grouped KV heads; null: num_heads
    head_dim: Optional[int] = None  # null: hidden_size // num_heads
    # Share the embedding and the lm_head (Qwen3-0.6B does): fewer weights, one matrix read twice.
    tie_word_embeddings: bool = False
    # bytes: 256 byte tokens + 3 special ones; qwen3: Qwen3's id layout, chat template and stop ids;
    # bpe: bytes merged into 512 ids (another tokenizer of the same text).
    tokenizer: str = "bytes"
    # Embedding rows past the tokenizer, as real models pad them (Qwen3: 151,936); null: one per token.
    vocab_rows: Optional[int] = None
    dtype: str = "float32"  # the dtype the weights are written in (`dtype: auto` then loads it)

    def check(self, where: str) -> None:
        """The toy's own rules, naming it by its config path (`model.toy`, `teacher.toy`, ...)."""
        for name in ("hidden_size", "intermediate_size", "max_position_embeddings", "num_heads", "num_layers"):
            check_range(f"{where}.{name}", getattr(self, name), at_least=1)
        check_range(f"{where}.head_dim", self.head_dim, at_least=1, null_ok=True)
        check_range(f"{where}.vocab_rows", self.vocab_rows, at_least=1, null_ok=True)
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"{where}.hidden_size={self.hidden_size} must be a multiple of {where}.num_heads={self.num_heads}"
                f" (or set {where}.head_dim)"
            )
        if self.num_kv_heads is not None and (self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads):
            raise ValueError(f"{where}.num_kv_heads={self.num_kv_heads} must divide {where}.num_heads={self.num_heads}")
        if self.tokenizer not in TOY_TOKENIZERS:
            raise ValueError(f"{where}.tokenizer={self.tokenizer!r}; choose one of {', '.join(TOY_TOKENIZERS)}")
        if self.dtype not in TOY_DTYPES:
            raise ValueError(f"{where}.dtype={self.dtype!r}; choose one of {', '.join(TOY_DTYPES)}")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


@dataclass
class LoraSettings:
    # LoRA rank (verl: lora_rank): more trainable weights and memory, more capacity.
    r: int = 16
    # LoRA scale numerator (verl: lora_alpha): the update is scaled by alpha / r.
    alpha: int = 32
    # Dropout on the LoRA input while training (0: the rollout's and the actor's distributions stay one).
    dropout: float = 0.0
    # The linear layers that get an adapter (verl: target_modules): a list of layer names, or the
    # string all-linear, every linear layer but the output layer (verl's default; any family's names).
    target_modules: Any = field(default_factory=lambda: ["q_proj", "v_proj"])
    # peft's LoRA bias setting: none trains no bias.
    bias: str = "none"

    def __post_init__(self) -> None:  # target_modules is typed Any: OmegaConf has no union of str and list
        check_range("model.lora.r", self.r, at_least=1)
        check_range("model.lora.alpha", self.alpha, above=0, why="LoRA scales its update by alpha / r")
        check_range("model.lora.dropout", self.dropout, at_least=0, below=1)
        targets = self.target_modules
        names = targets if isinstance(targets, (list, tuple)) else None
        if targets != ALL_LINEAR and not (names and all(isinstance(n, str) and n for n in names)):
            raise ValueError(
                f"model.lora.target_modules={targets!r}; give a list of layer names "
                f"(model.lora.target_modules=[q_proj,v_proj]) or {ALL_LINEAR}"
            )
        if names is not None:
            self.target_modules = list(names)

    def peft_targets(self) -> str | list[str]:
        """What peft's LoraConfig takes: the list, or the string all-linear."""
        return self.target_modules if self.target_modules == ALL_LINEAR else list(self.target_modules)

    def describe_targets(self) -> str:
        return ALL_LINEAR if self.target_modules == ALL_LINEAR else ", ".join(self.target_modules)


def check_common(where: str, quantization: str, dtype: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"{where}.quantization={quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if dtype not in DTYPES:
        raise ValueError(f"{where}.dtype={dtype!r}; choose one of {', '.join(DTYPES)}")


def hub_revision(model_id: str | None, revision: str | None) -> str | None:
    """The revision a model (or tokenizer) is loaded at: none for the toy or a local folder, whose
    files are what they are (a preset's pin, Qwen3's commit, names nothing there), else `revision`."""
    if revision is None or model_id in (None, "toy") or os.path.isdir(os.path.expanduser(model_id)):
        return None
    return revision


@dataclass
class StudentConfig:
    model_id: str = "toy"  # "toy", a hub id (pinned by `revision`) or a local directory
    # The hub revision (commit) of model_id, pinned so that a run names exactly its weights (unused
    # where model_id is a local folder: the report then records null).
    revision: Optional[str] = None
    tokenizer_id: Optional[str] = None  # defaults to model_id
    # The hub revision of tokenizer_id (unused where it is a local folder).
    tokenizer_revision: Optional[str] = None
    # Let transformers run the model repository's own code (verl: trust_remote_code); off by default.
    trust_remote_code: bool = False
    # The compute dtype: auto takes the checkpoint's (bf16 for Qwen3), float32 is exact and slower.
    dtype: str = "auto"
    # transformers' attention kernel: sdpa (the decode loop's fast path needs it) or eager.
    attn_implementation: str = "sdpa"
    # nf4: 4-bit weights with bitsandbytes (a quarter of the memory); none: the dtype's weights.
    quantization: str = "nf4"
    # peft's prepare_model_for_kbit_training on a quantized student (float32 norms and embedding).
    prepare_kbit_training: bool = True
    # Recompute activations in the backward pass (verl: enable_gradient_checkpointing): less memory, more time
    # (the real CPU recipe's update: 1.5x, the same gradients bit for bit; recipes/opd_k1_real_cpu/README.md).
    gradient_checkpointing: bool = True
    # The adapter the run trains.
    lora: LoraSettings = field(default_factory=LoraSettings)
    # Start from an existing PEFT adapter folder (verl: actor_rollout_ref.model.lora_adapter_path)
    # instead of a fresh LoRA; its own adapter_config.json then decides r, alpha and targets.
    adapter: Optional[str] = None
    # The random model built when model_id is toy.
    toy: ToyArchitecture = field(default_factory=ToyArchitecture)

    def __post_init__(self) -> None:
        check_common("model", self.quantization, self.dtype)
        self.toy.check("model.toy")
