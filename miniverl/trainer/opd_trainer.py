"""The single controller: drives rollout -> teacher -> actor once per optimizer update.

    trainer = OPDTrainer(cfg, resolved, run_dir)
    trainer.setup()            # data, plan, (resume checks), models, workers
    trainer.train()            # the fit loop over the plan's updates, checkpointing as it goes
    trainer.finish(status)     # PEFT adapter and report

Each update is timed phase by phase under verl's `timing_s/*` (no `timing_s/old_log_prob`: see actor.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from miniverl.config import MiniverlConfig
from miniverl.models import loading as models
from miniverl.trainer import plan as planning
from miniverl.trainer.checkpoint_state import checkpoint_state
from miniverl.trainer.metrics import batch_metrics, console_line, step_metrics, time_metrics
from miniverl.trainer.plan import Plan, UpdatePlan, compile_plan, derive_seed
from miniverl.trainer.report_page import write_report_page
from miniverl.trainer.run_report import build_report, resume_block, trainer_facts
from miniverl.trainer.validation import PROGRESS_METRICS, ValidationProbe, probe_owed
from miniverl.utils import checkpoint, resume_from
from miniverl.utils.dataset import PromptSet, tokenize_prompts
from miniverl.utils.device import resolve_device, set_determinism, timed
from miniverl.utils.downshift import Downshift, OutOfMemoryAtOneRow
from miniverl.utils.hydra_entry import log_line
from miniverl.utils.measure import release_memory, seconds_since_start
from miniverl.utils.run_folder import RunFolder
from miniverl.utils.run_names import ADAPTER, CHECKPOINTS, LOSS_KEY, PLAN, REPORT, RESOLVED_CONFIG, TOY_MODELS
from miniverl.utils.signals import deferred_signals
from miniverl.utils.tracking import Tracking
from miniverl.workers.actor import NonFiniteLoss
from miniverl.workers.advantages import compute_advantage
from miniverl.workers.factory import build_roles
from miniverl.workers.reward import RewardFailed, RewardWorker

log = logging.getLogger(__name__)


class OPDTrainer:
    def __init__(self, cfg: MiniverlConfig, resolved: dict, run_dir: Path):
        self.cfg = cfg
        self.resolved = resolved  # the composed config as written to resolved_config.yaml
        self.run_dir = Path(run_dir)
        self.history: list[dict] = []  # metrics of every update done so far (resumed ones included)
        self.resumed, self.last_checkpoint = None, None  # the Checkpoint resumed from; the last one written (a Path)
        self.failure, self.failure_cause = None, None  # a failed run's {update, reason}; its exception
        self.stopped_by: int | None = None  # the signal that stopped the run, if one did
        self.seconds_to_first: dict[str, float | None] = {"rollout": None, "teacher_targets": None, "update": None}
        self.progress: dict[str, list[dict]] = {}  # held-out k1_mean / exact_reverse_kl per evaluated update
        self.probe: ValidationProbe | None = None  # with eval.every != -1
        self.adapter_saved = False  # peft_adapter/ written (by finish, or before release_models)
        # Set by setup() (a run that fails there ends with its one-line error, and no report).
        self.device: torch.device | None = None
        self.tokenizer = self.student = None  # the student's tokenizer; the PeftModel the actor trains
        self.prompts, self.plan = None, None  # the PromptSet; the Plan compiled from the config and the prompts
        self.out, self.tracking = None, None  # the RunFolder; trainer.logger's trackers (tensorboard, wandb)
        self.reward: RewardWorker | None = None  # with estimator.use_task_rewards
        self.rollout = self.teacher = self.actor = None  # the roles (workers/factory.py)
        self.downshift = self.eval_downshift = None  # training's out-of-memory Downshift; the held-out probe's
        # For the report: what the roles were built with (workers/factory.RoleFacts), the rollout's last LeanDecode.
        self.role_facts, self.last_decode = None, None
        self.cold_startup_seconds = self.resume_load_seconds = None  # setup's end; a resumed checkpoint's load

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        self.device = resolve_device(cfg.hardware)
        set_determinism(self.device, cfg.hardware.deterministic)
        conversations = planning.read_rows(cfg)
        self.tokenizer = models.load_tokenizer("model", cfg.model, models.source_of(cfg.model, None))
        self.prompts: PromptSet = tokenize_prompts(conversations, cfg.data, self.tokenizer, cfg.recipe.prompt_limit)
        self.plan: Plan = compile_plan(cfg, self.prompts)
        contexts = planning.teacher_contexts(cfg, conversations, self.prompts.rows, self.tokenizer)
        # Teacher contexts and, with task rewards, reward rules are checked on every row before any model loads.
        self.reward = RewardWorker(self.tokenizer, self.prompts, cfg.reward) if cfg.estimator.use_task_rewards else None
        # Every resume check reads only; nothing is written before they all pass.
        self.resumed = resume_from.checkpoint_to_resume(cfg.trainer, self.run_dir, self.plan, self.device)
        self.out = RunFolder(
            self.run_dir,
            continuing=self.resumed is not None and self.resumed.run_dir.resolve() == self.run_dir.resolve(),
            overwrite=cfg.trainer.overwrite,
            plan_digest=self.plan.digest,
        )
        self.tracking = Tracking(cfg.trainer, self.run_dir)  # refused here if not installed; started by runner.py
        self.out.write_yaml(RESOLVED_CONFIG, self.resolved)
        self.out.write_json(PLAN, self.plan.to_dict(), canonical=True)
        # Toys go to the run folder and load as any model does; a toy teacher learns the rows it scores (its own).
        separate = {name: t for name, t in cfg.teacher_blocks.items() if t.mode == "standard"}
        toy_paths = models.materialize_toys(
            cfg.model,
            separate,
            self.out.path(TOY_MODELS),
            student_seed=derive_seed(cfg.trainer.seed, "toy"),
            corpus_texts=planning.toy_teacher_corpora(cfg, conversations),
        )
        self.student = models.load_student(
            cfg.model,
            models.source_of(cfg.model, toy_paths.get("student")),
            self.device,
            lora_seed=derive_seed(cfg.trainer.seed, "lora"),
            use_nf4_cache=cfg.hardware.nf4_cache,
        )
        roles = build_roles(cfg, self.student, self.tokenizer, self.device, toy_paths, contexts)
        self.rollout, self.teacher, self.actor = roles.rollout, roles.teacher, roles.actor
        self.role_facts = roles.facts  # for the report: the teachers' bytes, the products, an aligned tokenizer
        if cfg.eval.every != -1:
            self.probe = ValidationProbe.from_config(cfg, self.tokenizer, self.rollout, self.teacher, self.actor)
        self.downshift = Downshift.for_hardware(self.device, cfg.hardware, self.resumed)  # a resumed run: its sizes
        self.eval_downshift = Downshift.for_hardware(self.device, cfg.hardware, self.resumed, "eval_downshift")
        if self.resumed is not None:
            self.load_checkpoint(self.resumed)
        self.cold_startup_seconds = seconds_since_start()

    def evaluate(self, update: int, metrics: dict) -> Exception | None:
        """Held-out progress after `update` updates where it is owed, into self.progress and `metrics`; out
        of memory at one row or a failed task reward is returned, for fit to decide."""
        if self.probe is None or not probe_owed(self.progress, update, self.cfg.eval.every, len(self.plan.updates)):
            return None
        try:
            with timed("testing", timings := {}, self.device):  # verl's timing_s/testing, outside timing_s/step
                values = self.probe.measure(self.eval_downshift)  # out of memory halves its own rows, not training's
        except (OutOfMemoryAtOneRow, RewardFailed) as error:
            return error  # its checkpoint keeps the probe's sizes as of its last measure: these halvings did not help
        self.eval_downshift.commit()
        for key, value in values.items():
            self.progress.setdefault(key, []).append({"update": update, "value": value})
        metrics.update({PROGRESS_METRICS[k]: v for k, v in values.items()} | {"timing_s/testing": timings["testing"]})

    def load_checkpoint(self, ckpt: checkpoint.Checkpoint) -> None:
        start = time.perf_counter()
        checkpoint.restore(ckpt, self.student, self.actor.optimizer, self.actor.param_names)
        if ckpt.run_dir.resolve() != self.run_dir.resolve():  # the resumed run's trajectory log covers every update
            self.out.copy_trajectories(ckpt.run_dir, ckpt.update)
        self.out.trajectory_digests = list(ckpt.state["trajectory_digests"])
        self.history = list(ckpt.state["history"])
        self.progress = ckpt.state.get("distillation_progress", {})
        self.out.rewrite_metrics(self.history, create="jsonl" in self.cfg.trainer.logger)
        self.last_checkpoint, self.resume_load_seconds = ckpt.path, time.perf_counter() - start
        log.info("resumed from %s after update %d", ckpt.path, ckpt.update)

    # ------------------------------------------------------------------ train
    def train(self) -> str:
        """Runs the remaining updates; returns the status: measured (all done), interrupted or failed."""
        progress = dict(disable=not self.cfg.trainer.progress_bar, dynamic_ncols=True, unit="update")
        # Advanced after each update is logged, closed before the closing table: an early stop shows where it stands.
        with tqdm(desc="opd", initial=len(self.history), total=len(self.plan.updates), **progress) as bar:
            return self.fit(bar)

    def fit(self, bar) -> str:
        stop, done = self.cfg.trainer.stop_after_updates, len(self.history)
        if (error := self.evaluate_owed(done)) is not None:  # before training, or after a resumed update
            when = f"after update {done}" if done else "before training"
            return self.fail(done, f"held-out probe {when}: {error}", error)
        with deferred_signals() as stop_request:
            for update in self.plan.updates[done:]:  # the updates not done yet
                try:
                    metrics = self.fit_step(update)
                except (OutOfMemoryAtOneRow, NonFiniteLoss, RewardFailed) as error:
                    return self.fail(update.update, str(error), error)
                self.downshift.commit()  # the sizes this update ends with are its checkpoint's
                error = self.evaluate(update.update, metrics)
                self.log_update(update.update, metrics, bar)  # complete: a failed probe is owed to the resume
                if error is not None:
                    return self.fail(update.update, f"held-out probe after update {update.update}: {error}", error)
                if checkpoint.is_due(update.update, self.cfg.trainer, len(self.plan.updates)):
                    self.save_checkpoint(update.update)
                if update.update < len(self.plan.updates) and (update.update == stop or stop_request.signum):
                    self.ensure_checkpoint()
                    self.stopped_by = stop_request.signum  # main says how to resume
                    return "interrupted"
        self.stopped_by = stop_request.signum  # in the last update: the run is whole, main stops before its check
        return "measured"

    def evaluate_owed(self, done: int) -> Exception | None:
        """The probe owed before the first update (0 done), or after a resumed update whose probe failed in the
        run that checkpointed it: that update's metrics, logged without the probe's, are logged again with them."""
        held_out, total = {}, len(self.plan.updates)
        if (error := self.evaluate(done, held_out)) is not None or not done:
            return error
        if held_out:
            self.history[-1].update(held_out)
            self.out.rewrite_metrics(self.history, create="jsonl" in self.cfg.trainer.logger)
            self.tracking.log(held_out, done)
            log.info("held-out probe after update %d, which the checkpoint owed: %s", done, held_out)
        if checkpoint.is_due(done, self.cfg.trainer, total) and (held_out or done == total):
            self.save_checkpoint(done)  # with the probe's point, as the uninterrupted run's; at the end, finished
        return None

    def fail(self, update: int, reason: str, cause: BaseException) -> str:
        self.failure, self.failure_cause = {"update": update, "reason": reason}, cause
        self.ensure_checkpoint()  # of the last complete update
        return "failed"

    def log_update(self, update: int, metrics: dict, bar) -> None:
        self.history.append(metrics)
        if "jsonl" in self.cfg.trainer.logger:
            self.out.append_metrics(metrics)
        self.tracking.log(metrics, update)
        bar.set_postfix(loss=f"{metrics[LOSS_KEY]:.4f}", resp=f"{metrics['response_length/mean']:.1f}", refresh=False)
        bar.update(1)
        line = f"update {update}/{len(self.plan.updates)} {console_line(metrics)}"  # in main.log in any case
        log_line(log, line, console="console" in self.cfg.trainer.logger and not self.cfg.trainer.progress_bar)

    def fit_step(self, update: UpdatePlan) -> dict:
        cfg, timings, shift = self.cfg, {}, self.downshift
        prompts = self.prompts.token_ids_of(update.sample_rows)
        physical, chunks = update.rollout_physical_batches, update.update_chunks  # the plan's, as it fits
        with timed("step", timings, self.device):
            with timed("gen", timings, self.device):
                batch = shift.run(
                    "rollout",
                    physical,
                    lambda sizes: self.rollout.generate_sequences(
                        prompts,
                        list(update.sample_rows),
                        list(update.sample_seeds),
                        response_limit=cfg.recipe.response_limit,
                        physical_batches=sizes,
                    ),
                )
            self.mark_first("rollout")
            if self.reward is not None:  # task rewards: scored from the text, then grouped per prompt
                with timed("reward", timings, self.device):
                    batch = self.reward.compute_reward(batch)
                with timed("adv", timings, self.device):
                    batch = compute_advantage(batch, cfg.algorithm, cfg.rollout.n)
            with timed("teacher", timings, self.device):
                if update.sample_teachers:  # several teachers: each sample to the one the plan routed it to
                    batch = self.teacher.route(batch, update.sample_teachers)
                batch = shift.run(
                    "update_chunk", chunks, lambda sizes: self.teacher.compute_teacher_log_prob(batch, sizes[0])
                )
            self.mark_first("teacher_targets")
            with timed("update_actor", timings, self.device):
                dropout_seed = derive_seed(cfg.trainer.seed, "dropout", update.update)
                batch, actor_metrics = shift.run(
                    "update_chunk", chunks, lambda sizes: self.actor.update_actor(batch, sizes, dropout_seed)
                )
            self.mark_first("update")
            self.out.write_trajectory(update.update, batch)
        return {
            **step_metrics(update.update, self.plan.epoch_of(update.update)),
            **actor_metrics,
            **batch_metrics(batch, cfg.recipe),
            **time_metrics(batch, timings, self.device),
        }

    def mark_first(self, event: str) -> None:
        if self.seconds_to_first[event] is None:
            self.seconds_to_first[event] = round(seconds_since_start(), 4)

    # ------------------------------------------------------------------ checkpoints
    def ensure_checkpoint(self) -> None:
        """Checkpoint the last complete update unless this run's folder holds it (a resumed one may be another's)."""
        done, last = len(self.history), self.last_checkpoint
        mine = last is not None and last.resolve().is_relative_to(self.run_dir.resolve())
        if done and not (mine and checkpoint.checkpoint_update(last) >= done):
            self.save_checkpoint(done)

    def save_checkpoint(self, update: int) -> Path:
        state = checkpoint_state(self, update)  # state.json: what a resume needs beside the tensors
        self.last_checkpoint = checkpoint.save_checkpoint(
            self.out.path(CHECKPOINTS), update, self.student, self.actor.optimizer, self.actor.param_names, state
        )
        checkpoint.prune(self.run_dir, self.cfg.trainer.max_actor_ckpt_to_keep, update)  # once the new one is whole
        return self.last_checkpoint

    # ------------------------------------------------------------------ finish
    def finish(self, status: str = "measured", resume_check: dict | None = None) -> dict:
        """Save the PEFT adapter (once: after release_models it is on disk already) and write report.json;
        `resume_check`, the recipe's exact-resume verdict where it ran, becomes the report's `resume` block."""
        if not self.adapter_saved:
            self.save_adapter()
        resume = resume_check or resume_block(self.resumed, self.resume_load_seconds, len(self.history), self.plan)
        facts = trainer_facts(self, status, resume)
        report = build_report(self.cfg, self.plan, facts)
        write_report_page(report, self.history, self.run_dir)  # report.md and curves.png, before report.json:
        self.out.write_json(REPORT, report)  # a "measured" one says the run is whole (a rerun writes what is missing)
        self.tracking.finish(failed=status == "failed")
        return report

    def release_models(self) -> None:
        """Save the adapter, free the models, workers and optimizer: the resume check's runs get the device."""
        if not self.adapter_saved:
            self.save_adapter()
        self.last_decode = getattr(self.rollout, "last_decode", self.last_decode)
        self.probe = self.actor = self.teacher = self.rollout = self.student = None
        release_memory(self.device, compiled=self.cfg.hardware.rollout_compile)

    def save_adapter(self) -> None:
        checkpoint.save_adapter(self.student, self.out.path(ADAPTER))
        self.adapter_saved = True
