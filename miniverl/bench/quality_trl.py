"""The TRL sides of `bench --quality`: IWOPDTrainer (gamma 0) and DistillationTrainer (beta 1)
trained with the recipe's settings from the seed's LoRA initialisation; the LoRA weights are read
at the probed updates (0, half-way, the end) for miniverl's probe, and every update is timed
(generation, teacher, backward and optimizer step: what miniverl's `timing_s/step` covers)."""

from __future__ import annotations

import contextlib
import io
import time
import warnings
from pathlib import Path

from miniverl.utils.device import synchronize


def trl_missing() -> str | None:
    """Why the TRL sides cannot run here, or None."""
    try:
        import trl  # noqa: F401
    except ImportError as error:
        return f"TRL is not installed ({error}); install the optional extra: pip install -e .[bench]"
    return None


def trl_settings(config) -> dict:
    """TrainingArguments of both trainers from miniverl's config: one AdamW step per batch of the
    recipe's prompts, the same optimizer, clip, lengths, sampling and gradient checkpointing; a
    constant learning rate (TRL's default decays linearly to 0) and no autocast (NF4 layers
    compute in their dtype as loaded, LoRA in float32, as in miniverl)."""
    optim, recipe, rollout = config.actor.optim, config.recipe, config.rollout
    return {
        "per_device_train_batch_size": recipe.logical_batch,
        "gradient_accumulation_steps": 1,
        "max_steps": recipe.optimizer_updates,
        "max_completion_length": recipe.response_limit,
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "top_k": max(0, rollout.top_k),  # TRL's "off" is 0, verl's -1
        "learning_rate": optim.lr,
        "adam_beta1": optim.betas[0],
        "adam_beta2": optim.betas[1],
        "adam_epsilon": optim.eps,
        "weight_decay": optim.weight_decay,
        "max_grad_norm": config.actor.grad_clip,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "gradient_checkpointing": config.model.gradient_checkpointing,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "bf16": False,
        "use_cpu": config.hardware.device == "cpu" or not _cuda(),
        "seed": config.trainer.seed,
        "logging_strategy": "no",
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def trainer_for(name: str, prober, student, teacher, workdir: Path, callbacks: list):
    from miniverl.bench.opd_step import build_trl_trainer
    from miniverl.trainer.plan import read_rows

    config = prober.config
    conversations = read_rows(config).messages  # the train prompts; TRL orders them its own way
    return build_trl_trainer(
        "full_vocab" if name == "trl_distill" else "k1",
        student,
        teacher,
        prober.tokenizer,
        conversations,
        trl_settings(config),
        workdir,
        callbacks,
        max_length=config.recipe.prompt_limit + config.recipe.response_limit,
    )


def run_trl(name: str, prober, workdir: Path) -> dict:
    """Train one TRL side; returns its LoRA weights at the probed updates and its update times."""
    import trl
    from transformers import TrainerCallback

    from miniverl.bench.quality import dtype_names
    from miniverl.bench.setups import as_shipped
    from miniverl.models import loading as models
    from miniverl.trainer.plan import derive_seed

    config, device = prober.config, prober.device
    updates = config.recipe.optimizer_updates
    probed = {0, max(1, updates // 2), updates}

    class Recorder(TrainerCallback):
        def __init__(self):
            self.weights, self.seconds, self.start = {}, [], None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.weights[0] = prober.lora_weights(model)
            # What TRL trains, after its own casts: DistillationTrainer (1.16) turns a quantized
            # model's LoRA weights into bf16 (QLoRA's recommendation), IWOPDTrainer keeps them.
            self.adapter_dtype = dtype_names(p for p in model.parameters() if p.requires_grad)

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize(device)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            synchronize(device)
            self.seconds.append(time.perf_counter() - self.start)  # before the copy below
            if state.global_step in probed:
                self.weights[state.global_step] = prober.lora_weights(model)

    source = models.source_of(config.model, None)
    lora_seed, cached = derive_seed(config.trainer.seed, "lora"), config.hardware.nf4_cache
    student = models.load_student(config.model, source, device, lora_seed=lora_seed, use_nf4_cache=cached)
    teacher_source = models.source_of(config.teacher, None)
    teacher = models.load_teacher(config.teacher, teacher_source, device, use_nf4_cache=cached)
    # bitsandbytes' own CPU kernel choice, as a user's TRL script gets it (miniverl's loader
    # switches off its AVX512-BF16 repack; see models/loading.py).
    student, teacher = as_shipped(student, device) or student, as_shipped(teacher, device) or teacher
    recorder = Recorder()
    # TRL's own notices (experimental trainer, transformers' renamed arguments) and the Trainer's
    # closing metrics are not the bench's output.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        trainer = trainer_for(name, prober, student, teacher, workdir, [recorder])
        trainer.train()
    return {
        "weights": recorder.weights,
        "update_seconds": recorder.seconds,
        "adapter_dtype": recorder.adapter_dtype,
        "trl_version": trl.__version__,
    }
