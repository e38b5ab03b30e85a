"""Schema of `conf/teacher/`: the frozen teacher. Field names are those of the reference report's
`models.teacher` block."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from miniverl.config.bounds import check_range
from miniverl.config.model import ToyArchitecture, check_common

# standard: a separate frozen model (optionally with a PEFT adapter on top);
# ref: verl's reference policy, the student's own base with its LoRA disabled (no second copy);
# shared_base: `adapter` applied to the student's base (one copy of the base, two adapters).
TEACHER_MODES = ("standard", "ref", "shared_base")
# none: the teacher scores the student's token ids (the tokenizers must match); text: it scores the
# response's text in its own tokenization, aligned to the student's tokens by characters
# (miniverl's; verl has none: docs/teachers.md "A teacher with another tokenizer").
TOKENIZER_ALIGNMENTS = ("none", "text")
# How a span's estimate reaches the student's tokens of that span: all to its last token, or split evenly.
ALIGNMENT_CREDITS = ("last", "even")


@dataclass
class TeacherContext:
    """What the teacher sees that the student does not (miniverl's; verl v0.8.0 gives the teacher
    the student's prompt). Jinja templates over the row: every parquet column (`reward_model`,
    `extra_info`, `data_source`, any other) and `user`, the student's last user message. The
    teacher scores the student's sampled response after its own prompt."""

    system: Optional[str] = None  # a system message put first in the teacher's conversation
    user: Optional[str] = None  # the last user message, as the teacher sees it (e.g. "{{ user }} Hint: ...")
    prompt_limit: Optional[int] = None  # tokens of the teacher's prompt; null: recipe.prompt_limit

    @property
    def enabled(self) -> bool:
        return self.system is not None or self.user is not None

    def check(self, where: str) -> None:
        import jinja2

        for name in ("system", "user"):
            template = getattr(self, name)
            if template is None:
                continue
            try:
                jinja2.Environment().parse(template)
            except jinja2.TemplateSyntaxError as error:
                raise ValueError(
                    f"{where}.context.{name}: not a Jinja template ({error.message}, line {error.lineno})"
                ) from None
        check_range(f"{where}.context.prompt_limit", self.prompt_limit, at_least=1, null_ok=True)


@dataclass
class TeacherConfig:
    # With several teachers (`teachers.<name>`): the value of the row's `teacher_key` column this
    # teacher scores (verl: distillation.teacher_models.<name>.key). The single `teacher` reads none.
    key: Optional[str] = None
    # standard: a separate frozen model; ref: the student's base without its LoRA; shared_base: `adapter` on the
    # student's base.
    mode: str = "standard"
    # toy, a hub id (pinned by revision) or a local folder of a Hugging Face causal LM.
    model_id: str = "toy"
    # The hub revision (commit) of model_id (unused where model_id is a local folder: the report records null).
    revision: Optional[str] = None
    # The tokenizer checked against the student's (null: model_id's own).
    tokenizer_id: Optional[str] = None
    # The hub revision of tokenizer_id (unused where it is a local folder).
    tokenizer_revision: Optional[str] = None
    # Let transformers run the model repository's own code.
    trust_remote_code: bool = False
    # The compute dtype: auto takes the checkpoint's; float32 scores exactly, bf16 at half the memory.
    dtype: str = "float32"
    # transformers' attention kernel: sdpa or eager.
    attn_implementation: str = "sdpa"
    # nf4: 4-bit weights (a quarter of the memory, bf16 products); none: the dtype's weights.
    quantization: str = "nf4"
    # A PEFT adapter folder (standard: on top of model_id; shared_base: on the student's base).
    adapter: Optional[str] = None
    # The random model built when model_id is toy.
    toy: ToyArchitecture = field(default_factory=ToyArchitecture)
    # Seed of the toy teacher's initialisation; null: the student's own initialisation (with
    # toy_pretrain_steps > 0, a teacher that is a fine-tune of the student's base).
    toy_teacher_seed: Optional[int] = 99
    # Pretraining the toy teacher on the prompt corpus makes it differ from the student in a
    # learnable way (0 = a second random model).
    toy_pretrain_steps: int = 0
    # Learning rate of that pretraining.
    toy_pretrain_lr: float = 0.003
    # A privileged context: the teacher's own prompt, made from the row (null templates: the student's).
    context: TeacherContext = field(default_factory=TeacherContext)
    # none: the teacher's tokenizer must be the student's; text: a teacher with another tokenizer
    # scores the response's text in its own tokenization, after the prompt in its own chat template
    # (with the same tokenizer on both sides nothing changes: the run is the one without).
    tokenizer_alignment: str = "none"
    # With tokenizer_alignment=text: last (a span's estimate on its last student token) or even (split
    # over its student tokens). last keeps every estimator a function of the span's log-ratio.
    alignment_credit: str = "last"
    # With tokenizer_alignment=text, a byte the teacher's vocabulary has no token for (SmolLM2's lacks 21
    # of the 256; its tokenizer drops them): null leaves the span holding it out of the loss; a number
    # (nats, < 0) is the teacher's log-probability of each such byte, so the student pays for writing it.
    unwritable_byte_log_prob: Optional[float] = None

    @property
    def text_aligned(self) -> bool:
        return self.tokenizer_alignment == "text"

    def check(self, where: str = "teacher") -> None:
        """The teacher's own rules, naming it by its config path (`teacher`, `teachers.<name>`);
        the root config runs it for every teacher it reads."""
        check_common(where, self.quantization, self.dtype)
        self.toy.check(f"{where}.toy")
        self.context.check(where)
        if self.mode not in TEACHER_MODES:
            raise ValueError(f"{where}.mode={self.mode!r}; choose one of {', '.join(TEACHER_MODES)}")
        if self.mode == "shared_base" and not self.adapter:
            raise ValueError(
                f"{where}.mode=shared_base needs {where}.adapter=<PEFT adapter folder trained on the "
                "student's base model>"
            )
        if self.mode == "ref" and self.adapter:
            raise ValueError(
                f"{where}.mode=ref is the student's base without any adapter: drop {where}.adapter, "
                f"or use {where}.mode=shared_base"
            )
        if self.tokenizer_alignment not in TOKENIZER_ALIGNMENTS:
            raise ValueError(
                f"{where}.tokenizer_alignment={self.tokenizer_alignment!r}; "
                f"choose one of {', '.join(TOKENIZER_ALIGNMENTS)}"
            )
        floor = self.unwritable_byte_log_prob
        if floor is not None and not (math.isfinite(floor) and -1e4 < floor < 0):
            raise ValueError(
                f"{where}.unwritable_byte_log_prob={floor}: a finite log-probability between -10000 and 0 "
                "(nats per byte), or null to leave such bytes out of the loss"
            )
        if self.alignment_credit not in ALIGNMENT_CREDITS:
            raise ValueError(
                f"{where}.alignment_credit={self.alignment_credit!r}; choose one of {', '.join(ALIGNMENT_CREDITS)}"
            )
        if self.text_aligned and (self.mode != "standard" or self.context.enabled):
            raise ValueError(
                f"{where}.tokenizer_alignment=text needs a separate teacher model without a privileged context "
                f"({where}.mode=standard, no {where}.context): ref and shared_base share the student's tokenizer"
            )
        check_range(f"{where}.toy_pretrain_steps", self.toy_pretrain_steps, at_least=0)
        check_range(f"{where}.toy_pretrain_lr", self.toy_pretrain_lr, above=0)


def check_teachers(teachers: dict[str, TeacherConfig], teacher_key: str, default_teacher: Optional[str]) -> None:
    """Several teachers (verl's multi-teacher distillation): each names the key it scores, keys
    are distinct, and the default teacher (miniverl's; verl has none) is one of them."""
    if not teachers:
        if default_teacher is not None:
            raise ValueError(
                f"default_teacher={default_teacher!r} names no teacher: it picks one of teachers.<name> "
                "(+teacher@teachers.<name>=<option>); with the single `teacher` set default_teacher=null"
            )
        return
    # One entry is accepted, as verl accepts it: that teacher scores every row (its key is still
    # required, as verl's check_configured requires it of a named entry).
    if not teacher_key:
        raise ValueError("teacher_key is empty: name the data column that routes rows (verl's default: data_source)")
    owners: dict[str, str] = {}
    for name, teacher in teachers.items():
        if teacher.key is None:
            raise ValueError(
                f"teachers.{name}.key is not set: give the {teacher_key} value it scores (teachers.{name}.key=<value>)"
            )
        if teacher.key in owners:
            raise ValueError(
                f"teachers.{owners[teacher.key]} and teachers.{name} both have key={teacher.key!r}; each "
                f"teacher scores its own key: give one another (teachers.{name}.key=<value>) or drop one"
            )
        owners[teacher.key] = name
    shared = [n for n, t in teachers.items() if t.mode == "shared_base"]
    if len(shared) > 1:
        raise ValueError(
            f"teachers {', '.join(shared)} are all mode=shared_base: the student's base holds one teacher "
            "adapter; load the others as mode=standard with teacher.adapter"
        )
    if default_teacher is not None and default_teacher not in teachers:
        raise ValueError(f"default_teacher={default_teacher!r} is not one of teachers: {', '.join(teachers)}")
