"""One whole miniverl OPD update (`OursOPDStep`) and one on-policy step of TRL's trainers
(`DistillationTrainer`, experimental `IWOPDTrainer` as k1) on the same models, interleaved."""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable
from pathlib import Path

import torch

from miniverl.bench.measuring import best, median, seconds
from miniverl.bench.setups import BATCH, NEW_TOKENS, PROMPTS, Setup
from miniverl.utils.device import synchronize


class OursOPDStep:
    """One whole miniverl OPD update (as trainer.fit_step): rollout, teacher, then the update, whose
    own forward gives the old log-probs (on-policy; see actor.py). Each instance records its own
    steps (one per TRL comparison); `count` is shared so that every step samples new seeds."""

    count = 0

    def __init__(self, s: Setup, rollout, score, actor):
        self.s, self.rollout, self.score, self.actor = s, rollout, score, actor
        self.steps, self.phases = [], []

    def __call__(self, record: bool = True) -> None:
        s, times = self.s, {}
        OursOPDStep.count += 1
        seeds = [5000 + 1000 * OursOPDStep.count + i for i in range(BATCH)]
        total, _ = seconds(lambda: self._step(seeds, times), s.device)
        if record:
            self.steps.append((total, int(times.pop("tokens"))))
            self.phases.append(times)

    def _step(self, seeds, times):
        s = self.s
        times["gen"], batch = seconds(
            lambda: self.rollout.generate_sequences(
                s.prompt_ids, list(range(BATCH)), seeds, response_limit=NEW_TOKENS, physical_batches=[BATCH]
            ),
            s.device,
        )
        times["teacher"], batch = seconds(lambda: self.score(batch), s.device)
        times["update_actor"], _ = seconds(lambda: self.actor.update_actor(batch, [BATCH]), s.device)
        times["tokens"] = float(batch.response_mask.sum())

    def summary(self) -> dict | None:
        if not self.steps:
            return None
        return {
            "step_seconds": [round(sec, 4) for sec, _ in self.steps],
            "best_step_seconds": round(best([sec for sec, _ in self.steps]), 4),
            "median_step_seconds": round(median([sec for sec, _ in self.steps]), 4),
            "response_tokens": [tokens for _, tokens in self.steps],
            "median_phase_seconds": {k: round(median([p[k] for p in self.phases]), 4) for k in self.phases[0]},
        }


TRL_COMPUTES = {
    "full_vocab": "DistillationTrainer, beta=1: the full-vocabulary reverse KL (and the entropy) at every response "
    "position, from both models' lm_head over the whole vocabulary (chunked); on a 4-bit student it casts the "
    "LoRA weights to bf16 and steps them there (TRL's QLoRA rule; miniverl's stay float32)",
    "k1": "experimental IWOPDTrainer, distillation_objective='iw_opd', iw_opd_gamma=0: the sampled-token k1 policy "
    "gradient, -log p(y) * (log q(y) - log p(y)), the same objective as miniverl's, computed from both models' "
    "full (B, L, V) logits and log-softmax",
}


def trl_trainer(kind: str, s: Setup, student, repeats: int, workdir: Path, callbacks: list):
    """TRL's trainer of `kind`, on-policy (it generates with model.generate), the same models,
    batch, lengths, sampling, LoRA and gradient checkpointing as miniverl's step."""
    cuda = s.device.type == "cuda"
    common = {
        "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": 1,
        "max_steps": repeats,
        "max_completion_length": NEW_TOKENS,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "learning_rate": 1e-5,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.01,
        "max_grad_norm": 1.0,
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        # The recipe path's NF4 layers compute in bf16 as loaded, the rest in float32, as for
        # miniverl: no autocast. The float32 path on CUDA holds bfloat16 weights: autocast on.
        "bf16": cuda and s.path == "float32" and s.dtype == torch.bfloat16,
        "use_cpu": not cuda,
        "seed": 0,
        "logging_strategy": "no",
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    return build_trl_trainer(
        kind, student, s.teacher, s.tokenizer, conversations, common, workdir / f"trl_{kind}", callbacks,
        max_length=1024, shuffle_dataset=False,
    )  # fmt: skip


def build_trl_trainer(
    kind: str,
    student,
    teacher,
    tokenizer,
    conversations: list[list[dict]],
    settings: dict,
    workdir: Path,
    callbacks: list,
    *,
    max_length: int,
    shuffle_dataset: bool = True,
):
    """TRL's `DistillationTrainer` (beta 1, kind "full_vocab") or experimental `IWOPDTrainer`
    (iw_opd, gamma 0, kind "k1") on prompts only, with `settings` as its TrainingArguments."""
    from datasets import Dataset

    common = dict(model=student, teacher_model=teacher, processing_class=tokenizer, callbacks=callbacks)
    if kind == "full_vocab":
        from trl import DistillationConfig, DistillationTrainer

        args = DistillationConfig(output_dir=str(workdir), beta=1.0, shuffle_dataset=shuffle_dataset, **settings)
        return DistillationTrainer(args=args, train_dataset=Dataset.from_dict({"prompt": conversations}), **common)
    from trl.experimental.iw_opd import IWOPDConfig, IWOPDTrainer

    args = IWOPDConfig(
        output_dir=str(workdir),
        distillation_objective="iw_opd",
        iw_opd_gamma=0.0,
        lmbda=1.0,
        max_length=max_length,
        **settings,
    )
    trainer = IWOPDTrainer(args=args, train_dataset=Dataset.from_dict({"messages": conversations}), **common)
    # transformers counts the loss's tokens from the dataset's labels, before on-policy generation:
    # none for prompts only, and IWOPDTrainer (TRL 1.16) then divides by 0. Without the count it
    # takes the mean over the generated tokens (its own fallback).
    trainer.model_accepts_loss_kwargs = False
    return trainer


def bench_opd_step_trl(
    kind: str, s: Setup, student, repeats: int, workdir: Path, between: Callable[[], None]
) -> tuple[dict | None, str | None]:
    """`repeats` timed steps of TRL's trainer, each followed by `between()` (miniverl's step:
    interleaved, so a busy machine slows both alike). No warm-up step of its own: the kernels are
    warm from miniverl's warm-up step on the same models, and a first TRL step measured within the
    spread of the later ones here (docs/bench.md); the best of the steps counts."""
    try:
        import trl
        from transformers import TrainerCallback
    except ImportError as error:
        return None, f"TRL is not installed ({error}); install the optional extra: pip install -e .[bench]"

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.start, self.error = [], None, None

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize(s.device)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(s.device)
            self.times.append(time.perf_counter() - self.start)
            try:
                between()
            except Exception as error:  # noqa: BLE001 — miniverl's own failure, raised below
                self.error = error
                control.should_training_stop = True

    timer = StepTimer()
    try:
        trainer = trl_trainer(kind, s, student, repeats, workdir, [timer])
        with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its closing metrics
            trainer.train()
    except Exception as error:  # noqa: BLE001 — any failure of the peer is reported, not fatal
        if timer.error is not None:
            raise timer.error from None
        return None, f"TRL {trl.__version__} ({kind}) failed here: {type(error).__name__}: {error}"
    if timer.error is not None:
        raise timer.error
    if not timer.times:
        return None, "TRL ran no step"
    measured = timer.times
    return {
        "trl_version": trl.__version__,
        "computes": TRL_COMPUTES[kind],
        "step_seconds": [round(t, 4) for t in measured],
        "best_step_seconds": round(best(measured), 4),
        "median_step_seconds": round(median(measured), 4),
    }, None
