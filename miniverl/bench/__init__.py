"""`python -m miniverl.bench`: miniverl's OPD pieces side by side with what a user would pick
instead, in one process, on the same randomly initialised models and prompts (no downloads).

    python -m miniverl.bench [--scale toy|bench|mid|qwen3-0.6b-shape] [--path both|recipe|float32] [--out DIR]
    python -m miniverl.bench --student PATH --teacher PATH      # your own models: the `real` path (docs/bench.md)
    python -m miniverl.bench --quality --student PATH --teacher PATH   # learning per update vs TRL (quality.py)
    python -m miniverl.bench --losses                                  # the losses' memory (loss_memory.py)

Batch 4, 64 new tokens, LoRA r16 (alpha 32) on q_proj/v_proj, gradient checkpointing on the
student. Two paths, each with its own models:

- `recipe` (the default's headline, keys `recipe_*`): what `+recipe=opd_k1` runs. Random Qwen3
  models of the scale's shape are written in bfloat16 and loaded by miniverl's own
  `models.load_student` / `models.load_teacher`: NF4 student (bitsandbytes, bf16 compute,
  `prepare_model_for_kbit_training`, LoRA r16 on q/v, gradient checkpointing) and NF4 teacher;
- `float32` (extra rows, today's keys): the same shapes unquantized, float32 on the CPU
  (bfloat16 on CUDA).

On each path it measures

1. rollout tokens/s: miniverl's decode loop vs `model.generate(use_cache=True)` (batch 4) and vs
   one row at a time (`model.generate(use_cache=True)` per prompt, batch 1: what a simple
   trainer's rollout does); on the recipe path also vs the same loop on bitsandbytes' per-call
   dequantization (the dense copies' memory is reported);
2. sampled-token scoring by the teacher: time and peak memory vs
   `log_softmax(logits.float()).gather(...)` on the model's full logits;
3. one whole OPD update (rollout, teacher, update, whose forward also gives the old log-probs;
   k1 on the sampled token) vs one on-policy step of TRL's `DistillationTrainer` (beta=1: the
   full-vocabulary reverse KL, plus the entropy, at every response position of both models) and,
   on the recipe path, vs TRL's experimental `IWOPDTrainer` configured as k1 (`distillation_objective="iw_opd"`,
   `iw_opd_gamma=0`: the sampled-token k1 policy gradient, computed from both models' full
   logits) — the same models, batch, lengths and LoRA; TRL comes with the optional extra
   `pip install -e .[bench]`; without it those ratios are null, with the reason;
4. update positions/s vs a bare forward+backward of the same LoRA model
   (`model(..., labels=...).loss.backward()`).

It writes `bench.json` (ratios under stable keys, every measurement behind them, the machine) and
`bench.md` (the tables) to --out, and prints the tables. Each timing is the best of several
rounds once warm (a warm-up round of its own, or after a warm-up OPD step that ran the same
kernels), the methods interleaved round by round (timeit's convention: on a shared
machine the least disturbed run is the best estimate of a method's own cost; medians are kept in
bench.json too); peak memory is measured last (on the CPU from the process's peak RSS,
with glibc's mmap threshold pinned so that freed buffers leave the RSS; on CUDA from the
allocator's peak).

The modules: `setups` (the scales, prompts, ratio keys, targets and the two paths' models),
`measuring` (timing rounds, peak memory), `pieces` (rollout, scoring, update, one path's
measurements), `opd_step` (the whole OPD update vs TRL's trainers), `report` (the tables and the
machine), `cli` (the command line, `run`), and `quality` / `quality_trl` (`--quality`: miniverl and
TRL trained side by side, every student measured by miniverl's probe; docs/learning.md).
"""

from __future__ import annotations

from miniverl.bench.cli import main

__all__ = ["main"]
