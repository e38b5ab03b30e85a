"""Schema of `conf/teacher/`: the frozen teacher. Field names are those of the reference report's
`models.teacher` block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from miniverl.schema.model import ToyArchitecture, check_common

TEACHER_MODES = ("standard",)


@dataclass
class TeacherConfig:
    mode: str = "standard"  # a separate frozen model
    model_id: str = "toy"
    revision: Optional[str] = None
    tokenizer_id: Optional[str] = None
    tokenizer_revision: Optional[str] = None
    trust_remote_code: bool = False
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    quantization: str = "nf4"
    adapter: Optional[str] = None
    toy: ToyArchitecture = field(default_factory=ToyArchitecture)
    toy_teacher_seed: int = 99
    # Pretraining the toy teacher on the prompt corpus makes it differ from the student in a
    # learnable way (0 = a second random model).
    toy_pretrain_steps: int = 0
    toy_pretrain_lr: float = 0.003

    def __post_init__(self) -> None:
        check_common("teacher", self.quantization, self.dtype)
        if self.mode not in TEACHER_MODES:
            raise ValueError(f"teacher.mode={self.mode!r}; this version supports {', '.join(TEACHER_MODES)}")
        if self.adapter is not None:
            raise ValueError("teacher.adapter: teacher adapters are not supported yet; remove the override")
        if self.toy_pretrain_steps < 0:
            raise ValueError("teacher.toy_pretrain_steps must be >= 0")
