"""`python -m miniverl.export +recipe=opd_k1 [overrides]`: the recipe as a verl launch, for verl 0.9.1
or (export.verl_version=0.8.0) 0.8.0 (miniverl/verl_compat/launch_writer.py; docs/export.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from miniverl.utils.errors import MiniverlError, exit_code_of
from miniverl.utils.hydra_entry import one_line_hydra_errors, run_as_main
from miniverl.verl_compat.launch_writer import EXPORT_FOLDER, export


@one_line_hydra_errors
@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        result = export(cfg, Path(HydraConfig.get().runtime.output_dir) / EXPORT_FOLDER)
    except MiniverlError as error:
        sys.exit(exit_code_of(error))
    for warning in result.warnings:
        print(f"miniverl: warning: {warning}", file=sys.stderr)
    files = ", ".join(sorted(path.name for path in result.folder.iterdir()))
    print(f"verl v{cfg.export.verl_version} launch written to {result.folder} ({files})")


def cli() -> None:
    """The console script: runs this module as `python -m miniverl.export` does."""
    run_as_main("miniverl.export")


if __name__ == "__main__":
    main()
