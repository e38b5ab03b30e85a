"""The roles of one run built from its config: the rollout and the actor on the student (verl's
hybrid engine on one device), the teacher by its mode (a separate frozen model, or the student's
own base weights with ref / shared_base); several teachers behind one router, all loaded once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel

from miniverl.config import MiniverlConfig
from miniverl.config.teacher import TeacherConfig
from miniverl.models import adapters, cpu_gemm, tokenizers
from miniverl.models import loading as models
from miniverl.utils.measure import stored_weight_bytes
from miniverl.workers.actor import ActorWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.teacher import TeacherRouter, TeacherWorker
from miniverl.workers.text_aligned_teacher import TextAlignedTeacher


@dataclass(frozen=True)
class RoleFacts:
    """What the report says of the roles: kept after the models are released (no model in it)."""

    # Memory each teacher adds, by name: its own model's weights (standard), its adapter on the
    # student's base (shared_base), nothing (ref).
    teacher_weight_bytes: dict[str, int]
    products: str  # the half-precision products every role computes (cpu_gemm.product_name)
    aligned_teacher_tokenizer: Any = None  # a single text-aligned teacher's own tokenizer; None: it scores the ids


@dataclass
class Roles:
    rollout: RolloutWorker
    teacher: TeacherWorker | TeacherRouter | TextAlignedTeacher
    actor: ActorWorker
    facts: RoleFacts


def build_roles(
    cfg: MiniverlConfig,
    student: PeftModel,
    tokenizer,
    device: torch.device,
    toy_paths: dict[str, Path],
    contexts: dict[str, dict[int, list[int]]],
) -> Roles:
    """`toy_paths`: the toy teachers written to the run folder, by teacher name; `contexts`: the
    teachers' own prompts (a privileged context), by teacher name and parquet row."""
    hw, base = cfg.hardware, student.get_base_model()
    # Output rows past the tokenizer are padding: no role samples or scores them.
    vocab = len(tokenizer)
    float32_gemm = cpu_gemm.enabled_for(cfg.hardware, device)
    rollout = RolloutWorker(
        base,
        cfg.rollout,
        eos_ids=tokenizers.stop_token_ids(tokenizer, base),
        pad_id=tokenizer.pad_token_id,
        device=device,
        tokenizer_vocab=vocab,
        static_cache=hw.rollout_static_cache,
        compile_decode=hw.rollout_compile,
        cpu_gemv=hw.rollout_cpu_gemv,
        dequantize_4bit_once=hw.rollout_dequantize_4bit_once,
        cpu_prepack=hw.rollout_cpu_prepack,
        cpu_fp16_lm_head=hw.rollout_cpu_fp16_lm_head,
        float32_gemm=float32_gemm,
    )
    workers = {
        name: build_teacher(cfg, cfg.teacher_where(name), block, student, tokenizer, device, toy_paths.get(name))
        for name, block in cfg.teacher_blocks.items()
    }
    for name, prompts in contexts.items():
        workers[name] = workers[name].for_prompts(prompts)
    teacher = TeacherRouter(workers) if cfg.routed else next(iter(workers.values()))
    actor = ActorWorker(
        student,
        cfg.actor,
        cfg.estimator,
        temperature=cfg.rollout.temperature,
        logprob_chunk=hw.logprob_chunk,
        loss_scale_factor=cfg.recipe.response_limit,
        tokenizer_vocab=vocab,
        float32_gemm=float32_gemm,
        bypass_mode=cfg.algorithm.rollout_correction.bypass_mode,
        teacher_names=tuple(cfg.teachers) if cfg.routed else (),
        # reverse_kl_full, reverse_kl_topk: the actor forms each teacher's distribution from its hidden states
        teacher_heads=tuple(w.output_head for w in workers.values()) if cfg.estimator.uses_full_vocab else (),
        alignment_credit=cfg.teacher.alignment_credit,  # read with a text-aligned teacher (the single one)
    )
    computing = [base, *(w.model for w in workers.values() if getattr(w, "model", None) is not None)]
    products = cpu_gemm.product_name(float32_gemm, device, cpu_gemm.half_dtypes(computing))
    aligned = teacher.teacher_tokenizer if isinstance(teacher, TextAlignedTeacher) else None
    facts = RoleFacts({name: w.weight_bytes for name, w in workers.items()}, products, aligned)
    return Roles(rollout, teacher, actor, facts)


def with_contexts(
    teacher: TeacherWorker | TeacherRouter, contexts: dict[str, dict[int, list[int]]]
) -> TeacherWorker | TeacherRouter:
    """The run's teacher(s) with the contexts of other rows (the held-out prompts'), by teacher name."""
    if isinstance(teacher, TeacherRouter):
        return teacher.for_prompts(contexts)
    return teacher.for_prompts(next(iter(contexts.values()), None))  # one teacher: its context, if it has one


def build_teacher(
    cfg: MiniverlConfig,
    where: str,
    block: TeacherConfig,
    student: PeftModel,
    tokenizer,
    device: torch.device,
    toy_path: Path | None,
) -> TeacherWorker:
    """One teacher (`where`: its config path, for messages)."""
    common = dict(
        pad_id=tokenizer.pad_token_id,
        logprob_chunk=cfg.hardware.logprob_chunk,
        topk=cfg.estimator.topk if cfg.estimator.uses_topk else None,
        full_vocab=cfg.estimator.uses_full_vocab,
        tokenizer_vocab=len(tokenizer),
        float32_gemm=cpu_gemm.enabled_for(cfg.hardware, device),
    )
    if block.mode == "standard":  # a separate frozen model
        source = models.source_of(block, toy_path)
        teacher = models.load_teacher(block, source, device, where, cfg.hardware.nf4_cache)
        own = models.load_tokenizer(where, block, source)
        if block.text_aligned and tokenizers.tokenizers_differ(tokenizer, own):  # it scores text in its own tokens
            tokenizers.check_tokenizers_compatible(own, own, teacher, teacher, where)  # its output layer covers them
            worker = TeacherWorker(
                teacher,
                weight_bytes=stored_weight_bytes(teacher),
                **{**common, "tokenizer_vocab": len(own), "pad_id": own.pad_token_id},
            )
            stops = tokenizers.stop_token_ids(tokenizer, student.get_base_model())
            return TextAlignedTeacher(
                worker,
                tokenizer,
                own,
                stop_ids=stops,
                credit=block.alignment_credit,
                unwritable_byte_log_prob=block.unwritable_byte_log_prob,
            )
        tokenizers.check_tokenizers_compatible(tokenizer, own, student.get_base_model(), teacher, where)
        return TeacherWorker(teacher, weight_bytes=stored_weight_bytes(teacher), **common)
    # ref / shared_base: the teacher runs on the student's own base weights, no second copy.
    added = 0
    if block.mode == "shared_base":
        with models.quiet_loading():
            adapters.attach_shared_teacher(student, block.adapter, where)
        added = adapters.shared_teacher_bytes(student)
    switch = adapters.teacher_adapter_switch(student, block.mode)
    return TeacherWorker(student.get_base_model(), adapter_switch=switch, weight_bytes=added, **common)
