"""`report.json` (schema v1): the measurement a run leaves, with the reference report's field names.

This version fills the identity blocks (`recipe`, `models`, `hardware`, `verl`), the per-phase
steady-state medians and throughputs, and the artifact digests; docs/report.md says how each
figure is measured.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

from miniverl import VERL_COMMIT, VERL_REPOSITORY, VERL_TAG, __version__
from miniverl.identity import sha256_file
from miniverl.plan import Plan
from miniverl.schema import MiniverlConfig

SCHEMA_VERSION = 1
# Report phase -> the timing_s/* keys of metrics.jsonl it adds up.
PHASES = {"rollout": ("gen",), "teacher_scoring": ("teacher",), "actor_update": ("old_log_prob", "update_actor")}
THROUGHPUTS = {"rollout": "rollout_tokens_per_second", "teacher_scoring": "teacher_scored_positions_per_second",
               "actor_update": "update_positions_per_second"}


def steady_state(history: list[dict]) -> tuple[dict, dict]:
    """Median seconds and median tokens/s per phase over updates 2..N (update 1 pays warm-up)."""
    steady = history[1:] or history
    seconds, throughput = {}, {}
    for phase, keys in PHASES.items():
        per_update = [sum(m[f"timing_s/{k}"] for k in keys) for m in steady]
        rates = [m["response_length/sum"] / s for m, s in zip(steady, per_update) if s > 0]
        seconds[phase] = round(statistics.median(per_update), 4)
        throughput[THROUGHPUTS[phase]] = round(statistics.median(rates), 4) if rates else None
    return seconds, throughput


def checkpoint_facts(folder: Path | None) -> tuple[dict | None, int | None]:
    """The sha256 of each file of a checkpoint (from its verified state.json) and its size in bytes."""
    if folder is None:
        return None, None
    state = json.loads((folder / "state.json").read_text())
    hashes = {**state["files"], "state.json": sha256_file(folder / "state.json")}
    return hashes, sum((folder / name).stat().st_size for name in hashes)


def build_report(cfg: MiniverlConfig, plan: Plan, *, status: str, history: list[dict], hardware: dict,
                 artifacts: dict, measurements: dict, resume: dict) -> dict:
    seconds, throughput = steady_state(history) if history else ({}, {})
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": f"single_gpu_verl_{'pg' if cfg.estimator.use_policy_gradient else 'gkd'}_"
                f"{cfg.estimator.loss_mode}_systems_workload",
        "status": status,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "miniverl_version": __version__,
        "profile": cfg.recipe.profile,
        "recipe": {
            "compiled_plan_sha256": plan.digest,
            "estimator": cfg.estimator.loss_mode,
            "input_parquet_sha256": plan.input_parquet_sha256,
            "interrupt_after_updates": cfg.recipe.interrupt_after_updates,
            "logical_batch": cfg.recipe.logical_batch,
            "optimizer_updates": cfg.recipe.optimizer_updates,
            "policy_loss": cfg.estimator.policy_loss_mode if cfg.estimator.use_policy_gradient else None,
            "prompt_limit": cfg.recipe.prompt_limit,
            "prompts_available": plan.prompts_available,
            "prompts_consumed": plan.prompts_consumed,
            "response_limit": cfg.recipe.response_limit,
            "teacher_target": cfg.recipe.teacher_target,
        },
        "models": {"student": dataclasses.asdict(cfg.model), "teacher": dataclasses.asdict(cfg.teacher)},
        "hardware": hardware,
        "measurements": {
            **measurements,
            "steady_state_median_seconds": seconds,
            "steady_state_median_throughput": throughput,
        },
        "artifacts": artifacts,
        "resume": resume,
        "verl": {"commit": VERL_COMMIT, "distributed_execution_tested": False, "repository": VERL_REPOSITORY,
                 "tag": VERL_TAG},
    }
