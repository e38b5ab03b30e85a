"""The single controller: drives rollout -> teacher -> actor once per optimizer update.

    trainer = OPDTrainer(cfg, resolved, run_dir)
    trainer.setup()   # data, plan, models, workers
    trainer.train()   # the fit loop over the plan's updates
    trainer.finish()  # PEFT adapter and report

Each update is timed phase by phase under verl's `timing_s/*` names.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from miniverl import models
from miniverl.actor import ActorWorker
from miniverl.batch import Batch
from miniverl.data import PromptSet, read_conversations, tokenize_prompts
from miniverl.device import hardware_facts, resolve_device, set_determinism, timed
from miniverl.identity import sha256_file, sha256_json
from miniverl.outputs import RunFolder
from miniverl.plan import Plan, UpdatePlan, compile_plan, derive_seed
from miniverl.report import build_report
from miniverl.rollout import RolloutWorker
from miniverl.schema import MiniverlConfig
from miniverl.teacher import TeacherWorker

log = logging.getLogger(__name__)


class OPDTrainer:
    def __init__(self, cfg: MiniverlConfig, resolved: dict, run_dir: Path):
        self.cfg = cfg
        self.resolved = resolved  # the composed config as written to resolved_config.yaml
        self.run_dir = Path(run_dir)
        self.history: list[dict] = []
        self.started = time.perf_counter()

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        self.device = resolve_device(cfg.hardware)
        set_determinism(self.device, cfg.hardware.deterministic)
        self.out = RunFolder(self.run_dir)
        conversations = read_conversations(cfg.data)

        # Toy models are written to the run folder and then loaded like any hub model.
        toy_paths = models.materialize_toys(
            cfg.model, cfg.teacher, self.out.path("toy_models"), student_seed=derive_seed(cfg.trainer.seed, "toy"),
            corpus_texts=with_answers(conversations.messages, conversations.answers))
        student_src = models.source_of(cfg.model, toy_paths.get("student"))
        teacher_src = models.source_of(cfg.teacher, toy_paths.get("teacher"))
        self.tokenizer = models.load_tokenizer("model", student_src, cfg.model.trust_remote_code)
        teacher_tokenizer = models.load_tokenizer("teacher", teacher_src, cfg.teacher.trust_remote_code)

        self.prompts: PromptSet = tokenize_prompts(conversations, cfg.data, self.tokenizer, cfg.recipe.prompt_limit)
        self.plan: Plan = compile_plan(cfg, self.prompts)
        self.out.write_yaml("resolved_config.yaml", self.resolved)
        self.out.write_json("plan.json", self.plan.to_dict(), canonical=True)

        self.student = models.load_student(cfg.model, student_src, self.device,
                                           lora_seed=derive_seed(cfg.trainer.seed, "lora"))
        teacher = models.load_teacher(cfg.teacher, teacher_src, self.device)
        models.check_tokenizers_compatible(self.tokenizer, teacher_tokenizer, self.student.get_base_model(), teacher)

        hw = cfg.hardware
        # The rollout and the actor share one model object (verl's hybrid engine on one device).
        self.rollout = RolloutWorker(self.student.get_base_model(), cfg.rollout, eos_id=self.tokenizer.eos_token_id,
                                     pad_id=self.tokenizer.pad_token_id, device=self.device)
        self.teacher = TeacherWorker(teacher, rows_per_forward=hw.update_chunk, logprob_chunk=hw.logprob_chunk,
                                     topk=cfg.estimator.topk if cfg.estimator.uses_topk else None)
        self.actor = ActorWorker(self.student, cfg.actor, cfg.estimator, temperature=cfg.rollout.temperature,
                                 logprob_chunk=hw.logprob_chunk, loss_scale_factor=cfg.recipe.response_limit)
        self.setup_seconds = time.perf_counter() - self.started

    # ------------------------------------------------------------------ train
    def train(self) -> None:
        updates = self.plan.updates
        bar = tqdm(updates, desc="opd", unit="update", disable=not self.cfg.trainer.progress_bar, dynamic_ncols=True)
        for update in bar:
            metrics = self.fit_step(update)
            self.history.append(metrics)
            if "jsonl" in self.cfg.trainer.logger:
                self.out.append_metrics(metrics)
            bar.set_postfix(loss=f"{metrics['actor/distillation/loss']:.4f}",
                            resp=f"{metrics['response_length/mean']:.1f}")
            if "console" in self.cfg.trainer.logger and not self.cfg.trainer.progress_bar:
                log.info("update %d/%d %s", update.update, len(updates), console_line(metrics))

    def fit_step(self, update: UpdatePlan) -> dict:
        cfg, timings = self.cfg, {}
        with timed("step", timings, self.device):
            with timed("gen", timings, self.device):
                positions = [self.prompts.rows.index(r) for r in update.prompt_rows]
                batch = self.rollout.generate_sequences(
                    [self.prompts.token_ids[i] for i in positions], list(update.prompt_rows),
                    list(update.sample_seeds), response_limit=cfg.recipe.response_limit,
                    physical_batches=list(update.rollout_physical_batches))
            with timed("teacher", timings, self.device):
                batch = self.teacher.compute_teacher_log_prob(batch)
            with timed("old_log_prob", timings, self.device):
                batch.old_log_probs = self.actor.compute_log_prob(batch, rows_per_forward=cfg.hardware.update_chunk)
            with timed("update_actor", timings, self.device):
                actor_metrics, distillation_losses = self.actor.update_actor(batch, list(update.update_chunks))
            if cfg.estimator.use_policy_gradient:
                batch.advantages = -distillation_losses  # what the PG step maximised at each token
            self.out.write_trajectory(update.update, batch)
        return {"training/global_step": update.update, **actor_metrics, **batch_metrics(batch, cfg.recipe.response_limit),
                **{f"timing_s/{k}": round(v, 6) for k, v in timings.items()}}

    # ------------------------------------------------------------------ finish
    def finish(self, status: str = "completed") -> dict:
        adapter_dir = self.out.path("peft_adapter")
        self.student.save_pretrained(str(adapter_dir), safe_serialization=True)
        artifacts = {
            "standard_peft_adapter_sha256": sha256_json(
                {p.name: sha256_file(p) for p in sorted(adapter_dir.iterdir()) if p.is_file()}),
            "trajectory_sha256": self.out.trajectory_sha256,
        }
        rows = [r for u in self.plan.updates[: len(self.history)] for r in u.prompt_rows]
        measurements = {
            "adapter_bytes": sum(p.stat().st_size for p in adapter_dir.iterdir() if p.is_file()),
            "setup_seconds": round(self.setup_seconds, 4),
            "prompts_consumed": len(rows),
            "distinct_prompts_consumed": len(set(rows)),
            "observed_rollout_physical_batch_sizes": sorted({b for u in self.plan.updates[: len(self.history)]
                                                             for b in u.rollout_physical_batches}),
            "wall_seconds": round(time.perf_counter() - self.started, 4),
        }
        report = build_report(self.cfg, self.plan, status=status, history=self.history,
                              hardware=hardware_facts(self.device), artifacts=artifacts, measurements=measurements)
        self.out.write_json("report.json", report)
        return report


def with_answers(messages: list[list[dict]], answers: list[str | None]) -> list[list[dict]]:
    """Prompt conversations completed with their ground truth: the toy teacher's pretraining text."""
    return [m + ([{"role": "assistant", "content": a}] if a is not None else []) for m, a in zip(messages, answers)]


def batch_metrics(batch: Batch, response_limit: int) -> dict:
    lengths = batch.response_mask.sum(-1)  # (B,)
    prompt_lengths = batch.attention_mask[:, : batch.prompt_length].sum(-1).float()
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= response_limit).float().mean()),
        "response_length/sum": float(lengths.sum()),
        "prompt_length/mean": float(prompt_lengths.mean()),
        "prompt_length/max": float(prompt_lengths.max()),
    }


def console_line(metrics: dict) -> str:
    keys = ("actor/distillation/loss", "actor/grad_norm", "response_length/mean", "timing_s/step")
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
