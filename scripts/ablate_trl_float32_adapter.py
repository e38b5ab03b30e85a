"""Ablation (docs/learning.md): TRL's DistillationTrainer (beta 1) as `bench --quality` trains it,
but with its LoRA weights kept in float32. TRL 1.16 casts a quantized model's LoRA weights to bf16
when the trainer is built (QLoRA's recommendation) and its AdamW then steps them in bf16; miniverl and
IWOPDTrainer train them in float32. Prints the held-out exact KL of miniverl's probe at updates 0,
half-way and the last, for TRL as shipped and with the cast undone.

    python scripts/ablate_trl_float32_adapter.py SEED [--train FILE --heldout FILE] [--updates N]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from miniverl.bench import quality, quality_trl
from miniverl.models import real_fixture

BUILD = quality_trl.trainer_for  # the bench's own


def float32_adapter_trainer(name, prober, student, teacher, workdir, callbacks):
    trainer = BUILD(name, prober, student, teacher, workdir, callbacks)
    for param in trainer.model.parameters():
        if param.requires_grad:
            param.data = param.data.float()  # before train() builds the optimizer: AdamW on float32 weights
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("seed", type=int)
    parser.add_argument("--train", default="data/toy_prompts.parquet")
    parser.add_argument("--heldout", default="data/toy_prompts_heldout.parquet")
    parser.add_argument("--updates", type=int, default=16)
    cli = parser.parse_args()
    args = argparse.Namespace(
        student=str(real_fixture.student_dir()),  # $MINIVERL_CACHE/real/, as the recipe finds them
        teacher=str(real_fixture.teacher_dir()),
        train=cli.train,
        heldout=cli.heldout,
        updates=cli.updates,
        override=[],
    )
    prober = quality.Prober(quality.compose(args, cli.seed))
    for label, build in (("as shipped", BUILD), ("float32 LoRA", float32_adapter_trainer)):
        quality_trl.trainer_for = build
        with tempfile.TemporaryDirectory() as workdir:
            trained = quality_trl.run_trl("trl_distill", prober, Path(workdir))
        kl = {update: round(prober.measure(w), 3) for update, w in sorted(trained["weights"].items())}
        print(f"trl_distill seed {cli.seed}, {label} (LoRA trained in {trained['adapter_dtype']}): held-out KL {kl}")


if __name__ == "__main__":
    main()
