"""Schema of `conf/model/`: the student. Field names are those of the reference report's
`models.student` block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

QUANTIZATIONS = ("nf4", "none")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ToyArchitecture:
    """Sizes of a randomly initialised Qwen3 built when `model_id: toy`."""

    hidden_size: int = 64
    intermediate_size: int = 128
    max_position_embeddings: int = 1024
    num_heads: int = 4
    num_layers: int = 2

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"toy.hidden_size={self.hidden_size} must be a multiple of toy.num_heads={self.num_heads}")


@dataclass
class LoraSettings:
    enabled: bool = True
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    bias: str = "none"

    def __post_init__(self) -> None:
        if not self.enabled:
            raise ValueError("model.lora.enabled=false: miniverl trains LoRA adapters only; set it to true")
        if self.r < 1:
            raise ValueError(f"model.lora.r={self.r} must be >= 1")


def check_common(where: str, quantization: str, dtype: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"{where}.quantization={quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if dtype not in DTYPES:
        raise ValueError(f"{where}.dtype={dtype!r}; choose one of {', '.join(DTYPES)}")


@dataclass
class StudentConfig:
    model_id: str = "toy"  # "toy", a hub id (pinned by `revision`) or a local directory
    revision: Optional[str] = None
    tokenizer_id: Optional[str] = None  # defaults to model_id
    tokenizer_revision: Optional[str] = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    attn_implementation: str = "sdpa"
    quantization: str = "nf4"
    prepare_kbit_training: bool = True
    gradient_checkpointing: bool = True
    lora: LoraSettings = field(default_factory=LoraSettings)
    # Start from an existing PEFT adapter folder (verl: actor_rollout_ref.model.lora_adapter_path)
    # instead of a fresh LoRA; its own adapter_config.json then decides r, alpha and targets.
    adapter: Optional[str] = None
    toy: ToyArchitecture = field(default_factory=ToyArchitecture)

    def __post_init__(self) -> None:
        check_common("model", self.quantization, self.dtype)
