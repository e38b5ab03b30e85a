"""What the k1 students of `bench --quality` write at its last update: trains TRL's IW-OPD side for
one seed on the real fixture as the bench does, and samples the 16 held-out prompts with miniverl's
rollout (the probe's streams) from its LoRA at update 16 and from the miniverl k1 side of an earlier
bench run; prints each student's response lengths, held-out exact KL, its surprisal of its own
samples (nats per token: how deterministic it has become) and three samples.
docs/learning.md cites it.

    python -m miniverl.bench --quality --student … --teacher … --out BENCH
    python scripts/quality_samples.py SEED BENCH
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from peft import set_peft_model_state_dict
from safetensors.torch import load_file

from miniverl.bench import quality
from miniverl.bench.quality_trl import run_trl
from miniverl.models import real_fixture


def sample(prober, weights: dict, name: str) -> None:
    set_peft_model_state_dict(prober.student, weights)
    probe = prober.probe
    batch = probe.rollout.generate_sequences(
        probe.prompts.token_ids,
        probe.prompts.rows,
        probe.seeds,
        response_limit=probe.response_limit,
        physical_batches=[len(probe.prompts)],
    )
    lengths = [int(n) for n in batch.response_mask.sum(-1).tolist()]
    # The student's surprisal of its own samples: near 0 for a student that repeats one string exactly.
    surprisal = float(-(batch.rollout_log_probs * batch.response_mask).sum() / batch.response_mask.sum())
    kl = prober.measure(weights)
    print(name, "response lengths", lengths, f"held-out exact KL {kl:.3f}, own surprisal {surprisal:.3f} nats/token")
    for row in range(3):
        print("   ", repr(prober.tokenizer.decode(batch.responses[row, : lengths[row]].tolist())[:100]))


def main() -> None:
    seed, bench = int(sys.argv[1]), Path(sys.argv[2])
    args = argparse.Namespace(
        student=str(real_fixture.student_dir()),  # $MINIVERL_CACHE/real/, as the recipe finds them
        teacher=str(real_fixture.teacher_dir()),
        train="data/toy_prompts.parquet",
        heldout="data/toy_prompts_heldout.parquet",
        updates=16,
        override=[],
    )
    prober = quality.Prober(quality.compose(args, seed))
    with tempfile.TemporaryDirectory() as workdir:
        trained = run_trl("trl_iwopd", prober, Path(workdir))
    sample(prober, trained["weights"][16], "trl_iwopd@16")
    adapter = bench / "runs" / f"miniverl_k1_seed{seed}" / "peft_adapter" / "adapter_model.safetensors"
    sample(prober, load_file(str(adapter)), "miniverl_k1@16")


if __name__ == "__main__":
    main()
