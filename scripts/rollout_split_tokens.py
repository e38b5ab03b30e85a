"""Does the rollout sample the same tokens when its rows are split into other physical batches?
(docs/resume.md, "Physical batches and half precision"): the held-out prompts of a run's config,
sampled with the probe's streams at `hardware.rollout_physical_batch` rows per forward and at other
splits, compared row by row.

    python scripts/rollout_split_tokens.py +recipe=opd_k1_real_cpu
    python scripts/rollout_split_tokens.py +recipe=opd_k1 model=toy teacher=toy \
        data.val_files=data/toy_prompts_heldout.parquet

Each split draws the same uniforms per sample (one stream per sample); what can differ is the
products' rounding with another row count. Prints, per split, the rows whose tokens differ from
the configured split's, and the largest log-prob difference before any row's first other token.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from miniverl.config import to_config
from miniverl.trainer.opd_trainer import OPDTrainer
from miniverl.utils.downshift import split
from miniverl.utils.identity import resolved_config

ROOT = Path(__file__).resolve().parents[1]


def main(overrides: list[str]) -> None:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[*overrides, "eval.every=1"])
    config = to_config(cfg)
    with tempfile.TemporaryDirectory() as scratch:  # the run folder setup writes; nothing trains
        trainer = OPDTrainer(config, resolved_config(cfg), Path(scratch) / "run")
        trainer.setup()
    probe, rows = trainer.probe, len(trainer.probe.prompts)

    def sample(sizes: list[int]):
        return probe.rollout.generate_sequences(
            probe.prompts.token_ids,
            probe.prompts.rows,
            probe.seeds,
            response_limit=probe.response_limit,
            physical_batches=sizes,
        )

    configured = split(rows, config.hardware.rollout_physical_batch)
    reference = sample(configured)
    print(f"{rows} held-out prompts, {probe.response_limit} tokens, products: {trainer.products}")
    for size in sorted({1, 2, 4, 8, rows} - {config.hardware.rollout_physical_batch}):
        other = sample(split(rows, size))
        differing, before = [], 0.0
        for r in range(rows):
            unequal = (reference.responses[r] != other.responses[r]).nonzero()
            first = int(unequal[0]) if len(unequal) else reference.responses.shape[1]
            if first < reference.responses.shape[1]:
                differing.append(r)
            if first:
                gap = (reference.rollout_log_probs[r, :first] - other.rollout_log_probs[r, :first]).abs().max()
                before = max(before, float(gap))
        print(
            f"{size:>3} rows per forward against {config.hardware.rollout_physical_batch}: rows with other tokens "
            f"{len(differing)} of {rows} {differing}; largest log-prob difference before them {before:.2e}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
