"""The roles of one run built from its config: the rollout and the actor on the student (verl's
hybrid engine on one device), the teacher by its mode (a separate frozen model, or the student's
own base weights with ref / shared_base)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel

from miniverl.config import MiniverlConfig
from miniverl.models import adapters, cpu_gemm
from miniverl.models import loading as models
from miniverl.workers.actor import ActorWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.teacher import TeacherWorker


@dataclass
class Roles:
    rollout: RolloutWorker
    teacher: TeacherWorker
    actor: ActorWorker


def build_roles(
    cfg: MiniverlConfig, student: PeftModel, tokenizer, device: torch.device, teacher_toy_path: Path | None
) -> Roles:
    hw, base = cfg.hardware, student.get_base_model()
    # Output rows past the tokenizer are padding: no role samples or scores them.
    vocab = len(tokenizer)
    float32_gemm = cpu_gemm.enabled_for(cfg.hardware, device)
    rollout = RolloutWorker(
        base,
        cfg.rollout,
        eos_ids=models.stop_token_ids(tokenizer, base),
        pad_id=tokenizer.pad_token_id,
        device=device,
        tokenizer_vocab=vocab,
        static_cache=hw.rollout_static_cache,
        compile_decode=hw.rollout_compile,
        cpu_gemv=hw.rollout_cpu_gemv,
        dequantize_4bit_once=hw.rollout_dequantize_4bit_once,
        float32_gemm=float32_gemm,
    )
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
    )
    return Roles(rollout, build_teacher(cfg, student, tokenizer, device, teacher_toy_path), actor)


def build_teacher(
    cfg: MiniverlConfig, student: PeftModel, tokenizer, device: torch.device, toy_path: Path | None
) -> TeacherWorker:
    common = dict(
        logprob_chunk=cfg.hardware.logprob_chunk,
        topk=cfg.estimator.topk if cfg.estimator.uses_topk else None,
        tokenizer_vocab=len(tokenizer),
        float32_gemm=cpu_gemm.enabled_for(cfg.hardware, device),
    )
    if cfg.teacher.mode == "standard":  # a separate frozen model
        source = models.source_of(cfg.teacher, toy_path)
        teacher = models.load_teacher(cfg.teacher, source, device)
        models.check_tokenizers_compatible(
            tokenizer, models.load_tokenizer("teacher", cfg.teacher, source), student.get_base_model(), teacher
        )
        return TeacherWorker(teacher, **common)
    # ref / shared_base: the teacher runs on the student's own base weights, no second copy.
    if cfg.teacher.mode == "shared_base":
        with models.quiet_loading():
            adapters.attach_shared_teacher(student, cfg.teacher.adapter)
    return TeacherWorker(
        student.get_base_model(), context=adapters.teacher_context(student, cfg.teacher.mode), **common
    )
