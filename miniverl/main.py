"""Entry point: `python -m miniverl.main +recipe=opd_k1 [overrides]` (a Hydra app; -m for sweeps)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from miniverl.errors import MiniverlError
from miniverl.identity import resolved_config
from miniverl.schema import to_config

log = logging.getLogger("miniverl")


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Validate, set up, train and report; returns the report."""
    config = to_config(cfg)
    # bitsandbytes logs a warning at import when the optional `kernels` package is absent.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    from miniverl.trainer import OPDTrainer  # heavy imports (torch, transformers) after validation

    trainer = OPDTrainer(config, resolved_config(cfg), run_dir)
    trainer.setup()
    trainer.train()
    report = trainer.finish()
    log.info("run %s: report %s, adapter %s", report["status"], run_dir / "report.json", run_dir / "peft_adapter")
    return report


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg, Path(HydraConfig.get().runtime.output_dir))
    except MiniverlError as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"miniverl: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
