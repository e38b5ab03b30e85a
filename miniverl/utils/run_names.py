"""The names a run's outputs go by: its folder's files and the metrics other commands read back. One
place for each (the docs list them in docs/outputs.md); imports nothing, so the light readers (the
sweep summary at Hydra start-up, `report compare`, the console) use it without torch."""

from __future__ import annotations

RESOLVED_CONFIG = "resolved_config.yaml"  # the composed config, as the run read it
PLAN = "plan.json"  # the compiled plan: every update's prompts, seeds and sizes
METRICS = "metrics.jsonl"  # one line of metrics per update
REPORT = "report.json"  # what the run measured (trainer/run_report.py)
# Its schema, as this release writes it and `report compare` reads it (another version names other fields).
REPORT_SCHEMA_VERSION = 1
CHECKPOINTS = "checkpoints"  # checkpoints/update_<k>/
STATE = "state.json"  # a checkpoint's state beside its tensors (trainer/checkpoint_state.py)
TRAJECTORIES = "trajectories"  # trajectories/update_<k>.safetensors: each update's batch
ADAPTER = "peft_adapter"  # the standard PEFT adapter of the finished run
TOY_MODELS = "toy_models"  # the toy models a run writes and loads like any model
TENSORBOARD = "tensorboard"  # with trainer.logger tensorboard: its event files
WANDB = "wandb"  # with trainer.logger wandb: wandb's own files (offline runs, logs)
WANDB_RUN_ID = "wandb/miniverl_run_id.txt"  # the W&B run this folder's run logs to (a resume here goes on in it)

LOSS_KEY = "actor/distillation/loss"  # the update's distillation loss (per teacher: LOSS_KEY/<name>)
# Metrics that measure the machine (times, throughput, memory), not what training computed: an exact resume
# and a rerun compare everything else.
MACHINE_METRIC_PREFIXES = ("timing_s/", "timing_per_token_ms/", "perf/")
SCORE_KEY = "critic/score/mean"  # with task rewards: the mean task reward of the update's samples
