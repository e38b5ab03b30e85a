"""Schema of `conf/teacher/`: the frozen teacher. Field names are those of the reference report's
`models.teacher` block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from miniverl.config.model import ToyArchitecture, check_common

# standard: a separate frozen model (optionally with a PEFT adapter on top);
# ref: verl's reference policy, the student's own base with its LoRA disabled (no second copy);
# shared_base: `adapter` applied to the student's base (one copy of the base, two adapters).
TEACHER_MODES = ("standard", "ref", "shared_base")


@dataclass
class TeacherConfig:
    mode: str = "standard"
    model_id: str = "toy"
    revision: Optional[str] = None
    tokenizer_id: Optional[str] = None
    tokenizer_revision: Optional[str] = None
    trust_remote_code: bool = False
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    quantization: str = "nf4"
    adapter: Optional[str] = (
        None  # a PEFT adapter folder (standard: on top of model_id; shared_base: on the student's base)
    )
    toy: ToyArchitecture = field(default_factory=ToyArchitecture)
    # Seed of the toy teacher's initialisation; null: the student's own initialisation (with
    # toy_pretrain_steps > 0, a teacher that is a fine-tune of the student's base).
    toy_teacher_seed: Optional[int] = 99
    # Pretraining the toy teacher on the prompt corpus makes it differ from the student in a
    # learnable way (0 = a second random model).
    toy_pretrain_steps: int = 0
    toy_pretrain_lr: float = 0.003

    def __post_init__(self) -> None:
        check_common("teacher", self.quantization, self.dtype)
        if self.mode not in TEACHER_MODES:
            raise ValueError(f"teacher.mode={self.mode!r}; choose one of {', '.join(TEACHER_MODES)}")
        if self.mode == "shared_base" and not self.adapter:
            raise ValueError(
                "teacher.mode=shared_base needs teacher.adapter=<PEFT adapter folder trained on the "
                "student's base model>"
            )
        if self.mode == "ref" and self.adapter:
            raise ValueError(
                "teacher.mode=ref is the student's base without any adapter: drop teacher.adapter, "
                "or use teacher.mode=shared_base"
            )
        if self.toy_pretrain_steps < 0:
            raise ValueError("teacher.toy_pretrain_steps must be >= 0")
