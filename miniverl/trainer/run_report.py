"""`report.json` (schema v1): what a run measured, with the reference report's field names, units
and meanings (docs/report.md says how each figure is measured). Reading two reports side by side,
`python -m miniverl.report compare A.json B.json`, is the command's (miniverl/report.py).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from miniverl import VERL_COMMIT, VERL_REPOSITORY, VERL_TAG, __version__
from miniverl.config import MiniverlConfig
from miniverl.trainer.plan import PLAN_VERSION, Plan
from miniverl.trainer.report_models import student_block, teachers_block
from miniverl.utils.device import hardware_facts
from miniverl.utils.identity import sha256_file, sha256_json
from miniverl.utils.measure import (
    cuda_peaks,
    folder_bytes,
    peak_rss_gib,
    seconds_since_start,
    source_commit,
    workload_driver_sha256,
)
from miniverl.utils.run_names import ADAPTER, REPORT_SCHEMA_VERSION, STATE, TOY_MODELS
from miniverl.verl_compat.launch_writer import field_rule_digest

PROFILE_SCHEMA_VERSION = 1
# Report phase -> the timing_s/* keys of metrics.jsonl it adds up.
PHASES = {"rollout": ("gen",), "teacher_scoring": ("teacher",), "actor_update": ("update_actor",)}
THROUGHPUTS = {
    "rollout": "rollout_tokens_per_second",
    "teacher_scoring": "teacher_scored_positions_per_second",
    "actor_update": "update_positions_per_second",
}
SCIENTIFIC_SCOPE = {"algorithm_comparison": False, "runtime_correctness_only": True, "task_quality_evaluated": False}


@dataclass
class RunFacts:
    """What the trainer observed, handed to `build_report`."""

    status: str
    history: list[dict]
    hardware: dict
    run_dir: Path
    last_checkpoint: Path | None
    seconds_to_first: dict[str, float | None]  # rollout / teacher_targets / update, from process start
    cold_startup_seconds: float
    peak_allocated_gib: float | None
    peak_reserved_gib: float | None
    peak_rss_gib: float
    batch_downshifts: dict[str, int]
    observed_rollout_physical_batch_sizes: list[int]
    trajectory_sha256: str
    resolved_config_digest: str
    resume: dict
    failure: dict | None = None
    workload_seconds: float = 0.0
    distillation_progress: dict | None = None
    teacher_weight_bytes: dict[str, int] = field(default_factory=dict)  # by teacher name ("teacher": the single one)
    tokenizer_alignment: dict | None = None  # a teacher of another tokenizer: alignment_block
    first_own_update: int = 0  # the history's first update this process ran (a resumed run's: after its checkpoint)
    extra_measurements: dict = field(default_factory=dict)


def device_facts(device: torch.device, products: str | None, decode=None, option: str | None = None) -> dict:
    """RunFacts' device fields: the hardware (`option`: the hardware option's name), the half-precision
    products every role computed (models/cpu_gemm.py), the rollout's CPU decode paths (`decode`: its
    last LeanDecode), and the peak memory of this process so far."""
    peak_allocated, peak_reserved = cuda_peaks(device)
    decode_paths = None
    if decode is not None and device.type == "cpu":
        decode_paths = {"reordered_layers": decode.reordered_layers, "fp16_lm_head": decode.fp16_head_bytes > 0}
    return {
        "hardware": {**hardware_facts(device), "option": option, "products": products, "rollout_decode": decode_paths},
        "peak_allocated_gib": peak_allocated,
        "peak_reserved_gib": peak_reserved,
        "peak_rss_gib": peak_rss_gib(),
    }


def task_rewards_block(cfg: MiniverlConfig) -> dict | None:
    """How the task reward was scored and weighed (None: pure distillation)."""
    if not cfg.estimator.use_task_rewards:
        return None
    custom = cfg.reward.custom_reward_function
    return {
        "adv_estimator": cfg.algorithm.adv_estimator,
        "norm_adv_by_std_in_grpo": cfg.algorithm.norm_adv_by_std_in_grpo,
        "distillation_loss_coef": cfg.estimator.distillation_loss_coef,
        "reward_function": f"{custom.path}:{custom.name}" if custom.path else "rule of data_source",
    }


def trainer_facts(trainer, status: str, resume: dict) -> RunFacts:
    """The facts an OPDTrainer observed (its run so far), for the report."""
    shifts = [trainer.downshift, trainer.eval_downshift]
    return RunFacts(
        **device_facts(
            trainer.device,
            trainer.role_facts.products,
            getattr(trainer.rollout, "last_decode", trainer.last_decode),
            trainer.cfg.hardware.name,
        ),
        status=status,
        history=trainer.history,
        run_dir=trainer.run_dir,
        last_checkpoint=trainer.last_checkpoint,
        seconds_to_first=trainer.seconds_to_first,
        cold_startup_seconds=trainer.cold_startup_seconds,
        # Training's and the held-out probe's downshifts (each has its own sizes) together.
        batch_downshifts={kind: sum(shift.counts[kind] for shift in shifts) for kind in trainer.downshift.counts},
        observed_rollout_physical_batch_sizes=sorted(set().union(*(shift.observed["rollout"] for shift in shifts))),
        trajectory_sha256=trainer.out.trajectory_sha256,
        resolved_config_digest=sha256_json(trainer.resolved),
        resume=resume,
        failure=trainer.failure,
        workload_seconds=seconds_since_start(),
        distillation_progress=trainer.progress if trainer.cfg.eval.every != -1 else None,
        teacher_weight_bytes=trainer.role_facts.teacher_weight_bytes,
        tokenizer_alignment=alignment_block(trainer),
        first_own_update=trainer.resumed.update if trainer.resumed else 0,
    )


def alignment_block(trainer) -> dict | None:
    """With teacher.tokenizer_alignment=text: both tokenizers, whether the alignment ran (it does
    not where the tokenizers are the same), and over the updates the fraction of response tokens
    left unaligned and the fraction of the text's bytes scored at teacher.unwritable_byte_log_prob;
    None without it."""
    if not trainer.cfg.teacher.text_aligned or trainer.cfg.teachers:
        return None
    own = trainer.role_facts.aligned_teacher_tokenizer  # None: the teacher scores the student's ids
    unaligned = over_updates(trainer.history, "distillation/unaligned_fraction")
    floored = over_updates(trainer.history, "distillation/unwritable_byte_fraction")  # only with the floor set
    return {
        "applied": "none: the teacher's tokenizer is the student's" if own is None else "text",
        "credit": trainer.cfg.teacher.alignment_credit,
        "student_tokenizer": tokenizer_facts(trainer.tokenizer),
        "teacher_tokenizer": None if own is None else tokenizer_facts(own),
        "unaligned_fraction_mean": unaligned["mean"],
        "unaligned_fraction_max": unaligned["max"],
        "unwritable_byte_log_prob": None if own is None else trainer.cfg.teacher.unwritable_byte_log_prob,
        "unwritable_byte_fraction_mean": floored["mean"],
        "unwritable_byte_fraction_max": floored["max"],
    }


def over_updates(history: list[dict], key: str) -> dict:
    """The mean and the largest of one metric over the updates that logged it (None where none did)."""
    values = [m[key] for m in history if key in m]
    return {"mean": sum(values) / len(values) if values else None, "max": max(values) if values else None}


def tokenizer_facts(tokenizer) -> dict:
    return {
        "class": type(tokenizer).__name__,
        "name_or_path": tokenizer.name_or_path,
        "vocabulary": len(tokenizer),
        "vocabulary_sha256": sha256_json(sorted(tokenizer.get_vocab().items())),
        "eos_token": tokenizer.eos_token,
    }


def resume_check_noted(cfg: MiniverlConfig, facts) -> bool:
    """Whether the report's resume block carries recipe.resume_check_note: where the check ran, or where a
    single update leaves it none; not for a sweep job, a resumed run or a stopped one, which skip it."""
    return facts.resume.get("status") in ("exact_match", "mismatch") or cfg.recipe.resume_check_after is None


def resume_block(resumed, load_seconds: float | None, updates_done: int, plan: Plan) -> dict:
    """The report's `resume` block of a run that did not check its own resume: whether it resumed
    (a utils.checkpoint.Checkpoint, or None), from where, and where it stands."""
    return {
        "status": "resumed" if resumed else "not_checked",
        "resumed_from": str(resumed.path) if resumed else None,
        # trainer.resume_inexact: how this process, or an earlier resume of the run, computed otherwise than the
        # process before it.
        "inexact_because": (resumed.inexact_because or None) if resumed else None,
        "resumed_after_update": resumed.update if resumed else None,
        "resume_load_seconds": round(load_seconds, 4) if resumed else None,
        "global_optimizer_steps": updates_done,
        "task_cursor": plan.task_cursor(updates_done),
    }


def with_resume_check(report: dict, block: dict, run_bytes: int) -> dict:
    """A finished run's report with the resume check's verdict as its `resume` block (the note
    kept) and the folder's bytes now counting the check's two runs."""
    resume = {**block, "note": report["resume"].get("note")}
    return {**report, "resume": resume, "artifacts": {**report["artifacts"], "total_workload_bytes": run_bytes}}


def steady_state(history: list[dict], first_own_update: int = 0) -> tuple[dict, dict]:
    """Median seconds and median positions/s per phase over this process's updates after its first
    (`history[first_own_update]` pays the warm-up; a resumed run's earlier updates were another
    process's); None with one update of its own (its figures are the warm-up's: metrics.jsonl has them)."""
    steady = history[first_own_update + 1 :]
    seconds, throughput = {}, {}
    for phase, keys in PHASES.items():
        per_update = [sum(m[f"timing_s/{k}"] for k in keys) for m in steady]
        rates = [m["response_length/sum"] / s for m, s in zip(steady, per_update) if s > 0]
        seconds[phase] = round(statistics.median(per_update), 4) if per_update else None
        throughput[THROUGHPUTS[phase]] = round(statistics.median(rates), 4) if rates else None
    return seconds, throughput


def checkpoint_facts(folder: Path | None) -> tuple[dict | None, int | None]:
    """The sha256 of each file of a checkpoint (from its verified state.json) and its size in bytes."""
    if folder is None:
        return None, None
    state = json.loads((folder / STATE).read_text())
    hashes = {**state["files"], STATE: sha256_file(folder / STATE)}
    return hashes, folder_bytes(folder)


def profile_identity(cfg: MiniverlConfig) -> dict:
    """Names and versions of what defines the profile; `digest` hashes all the others."""
    est = cfg.estimator
    flavour = f"{'pg' if est.use_policy_gradient else 'gkd'}-{est.loss_mode}"
    identity = {
        "export_version": f"verl-opd-{flavour}-export-v1",
        "field_rule_digest": field_rule_digest(),
        "loss_conformance_version": f"{flavour}-verl-v0.8-v1",
        "native_compiler_version": f"{flavour}-native-v{PLAN_VERSION}",
        "profile_name": cfg.recipe.profile,
        "profile_schema_version": PROFILE_SCHEMA_VERSION,
        "upstream_commit": VERL_COMMIT,
        "upstream_repository": VERL_REPOSITORY,
        "upstream_tag": VERL_TAG,
    }
    return {"digest": sha256_json(identity), **identity}


def resource_contract(cfg: MiniverlConfig, facts: RunFacts) -> dict:
    hw, on_gpu = cfg.hardware, facts.hardware.get("device") == "cuda"
    gpu_seconds = round(facts.workload_seconds, 1) if on_gpu else None
    reserved = facts.peak_reserved_gib
    return {
        "gpu_hour_limit": hw.gpu_hour_limit,
        "peak_reserved_limit_gib": hw.peak_reserved_limit_gib,
        "peak_reserved_within_limit": (
            reserved <= hw.peak_reserved_limit_gib
            if reserved is not None and hw.peak_reserved_limit_gib is not None
            else None
        ),
        "total_gpu_workload_seconds": gpu_seconds,
        "gpu_hours_within_limit": (
            gpu_seconds / 3600 <= hw.gpu_hour_limit
            if gpu_seconds is not None and hw.gpu_hour_limit is not None
            else None
        ),
        "total_workload_seconds": round(facts.workload_seconds, 3),
    }


def build_report(cfg: MiniverlConfig, plan: Plan, facts: RunFacts) -> dict:
    seconds, throughput = steady_state(facts.history, facts.first_own_update) if facts.history else ({}, {})
    done = plan.updates[: len(facts.history)]
    rows = [r for u in done for r in u.prompt_rows]
    run_dir = facts.run_dir
    adapter_dir = run_dir / ADAPTER
    ckpt_hashes, ckpt_bytes = checkpoint_facts(facts.last_checkpoint)
    est = cfg.estimator
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "kind": f"single_gpu_verl_{'pg' if est.use_policy_gradient else 'gkd'}_{est.loss_mode}_systems_workload",
        "status": facts.status,
        "failure": facts.failure,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "miniverl_version": __version__,
        "source_commit": source_commit(),
        "workload_driver_sha256": workload_driver_sha256(),
        "profile": cfg.recipe.profile,
        "profile_identity": profile_identity(cfg),
        "run_identity": {"resolved_config_digest": facts.resolved_config_digest},
        "recipe": {
            "compiled_plan_sha256": plan.digest,
            "estimator": est.loss_mode,
            # What the objective adds to the estimator beyond verl (docs/objectives.md); verl's: 0.0, none, none.
            "kl_discount_factor": est.kl_discount_factor,
            "advantage_baseline": est.advantage_baseline,
            "token_selection": {"by": est.token_selection.by, "keep": est.token_selection.keep},
            "input_parquet_sha256": plan.input_parquet_sha256,
            "train_files": list(cfg.data.train_files),  # as given; the bytes are the digest's
            "interrupt_after_updates": cfg.recipe.resume_check_after,  # the update the check stops after
            "logical_batch": cfg.recipe.logical_batch,
            "optimizer_updates": cfg.recipe.optimizer_updates,
            "policy_loss": est.policy_loss_mode if est.use_policy_gradient else None,
            "loss_agg_mode": est.loss_agg_mode,
            "prompt_limit": cfg.recipe.prompt_limit,
            "prompts_available": plan.prompts_available,
            "prompts_consumed": plan.prompts_consumed,
            "response_limit": cfg.recipe.response_limit,
            "samples_per_prompt": cfg.rollout.n,
            "task_rewards": task_rewards_block(cfg),
            "teacher_target": cfg.estimator.teacher_target,
        },
        "models": {
            "student": student_block(cfg),
            **teachers_block(cfg, facts.teacher_weight_bytes),
        },
        "hardware": facts.hardware,
        "measurements": {
            "adapter_bytes": folder_bytes(adapter_dir),
            "batch_downshifts": facts.batch_downshifts,
            "cache_bytes": folder_bytes(run_dir / TOY_MODELS),
            "checkpoint_bytes": ckpt_bytes,
            "cold_startup_seconds": round(facts.cold_startup_seconds, 4),
            "distinct_prompts_consumed": len(set(rows)),
            "observed_rollout_physical_batch_sizes": facts.observed_rollout_physical_batch_sizes,
            "peak_allocated_gib": facts.peak_allocated_gib,
            "peak_reserved_gib": facts.peak_reserved_gib,
            "peak_rss_gib": facts.peak_rss_gib,
            "prompts_consumed": len(rows),
            "steady_state_median_seconds": seconds,
            "steady_state_median_throughput": throughput,
            "time_to_first_rollout_seconds": facts.seconds_to_first["rollout"],
            "time_to_first_teacher_targets_seconds": facts.seconds_to_first["teacher_targets"],
            "time_to_first_update_seconds": facts.seconds_to_first["update"],
            "total_run_bytes": folder_bytes(run_dir, exclude=("resume_check",)),
            **facts.extra_measurements,
        },
        "artifacts": {
            "checkpoint_hashes": ckpt_hashes,
            "standard_peft_adapter_sha256": sha256_file(adapter_dir / "adapter_model.safetensors"),
            "total_workload_bytes": folder_bytes(run_dir),
            "trajectory_sha256": facts.trajectory_sha256,
        },
        **({"tokenizer_alignment": facts.tokenizer_alignment} if facts.tokenizer_alignment else {}),
        "resource_contract": resource_contract(cfg, facts),
        # The note says where the check interrupted: only where it ran (or why a 1-update run has none).
        "resume": {**facts.resume, "note": cfg.recipe.resume_check_note if resume_check_noted(cfg, facts) else None},
        # Additive to schema v1: held-out progress, [{"update": u, "value": v}, ...] from update 0.
        "distillation_progress": None
        if facts.distillation_progress is None
        else {
            "k1_mean": facts.distillation_progress.get("k1_mean", []),
            "exact_reverse_kl": (
                facts.distillation_progress.get("exact_reverse_kl")
                if all(p["value"] is not None for p in facts.distillation_progress.get("exact_reverse_kl", []))
                else None
            ),
            "task_score": facts.distillation_progress.get("task_score"),  # where held-out rows can be scored
            **(
                {"teacher_loglik_per_char": facts.distillation_progress["teacher_loglik_per_char"]}
                if "teacher_loglik_per_char" in facts.distillation_progress  # a teacher of another tokenizer
                else {}
            ),
            "every": cfg.eval.every,
            "heldout_files": list(cfg.data.val_files),
        },
        "scientific_scope": SCIENTIFIC_SCOPE,
        "verl": {
            "commit": VERL_COMMIT,
            "distributed_execution_tested": False,
            "repository": VERL_REPOSITORY,
            "tag": VERL_TAG,
        },
    }
