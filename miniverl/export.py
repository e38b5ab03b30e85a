"""`python -m miniverl.export +recipe=opd_k1 [overrides]`: the recipe as a verl launch, for verl 0.9.1
or (export.verl_version=0.8.0) 0.8.0 (miniverl/verl_compat/launch_writer.py; docs/export.md)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from miniverl.config.export import EXPORT_FOLDER
from miniverl.utils.errors import MiniverlError, exit_code_of
from miniverl.utils.hydra_entry import KeepEarlierRunRecord, log_line, one_line_hydra_errors, run_as_main, write_record
from miniverl.verl_compat.field_rules import verl_key_hints
from miniverl.verl_compat.launch_writer import export

log = logging.getLogger("miniverl")


@one_line_hydra_errors(verl_hints=verl_key_hints)
@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        result = export(cfg, run_dir / EXPORT_FOLDER)
    except MiniverlError as error:
        log_line(log, str(error), logging.ERROR)  # export.log, beside the console's line
        sys.exit(exit_code_of(error))
    if KeepEarlierRunRecord.kept_export_record:  # this export replaced the earlier one: its record too
        write_record(cfg, hydra_cfg, run_dir / ".hydra")
    for warning in result.warnings:
        print(f"miniverl: warning: {warning}", file=sys.stderr)
        log_line(log, warning, logging.WARNING)
    files = ", ".join(sorted(path.name for path in result.folder.iterdir()))
    written = f"verl v{cfg.export.verl_version} launch written to {result.folder} ({files})"
    print(written)
    log_line(log, written)


def cli() -> None:
    """The console script: runs this module as `python -m miniverl.export` does."""
    run_as_main("miniverl.export")


if __name__ == "__main__":
    main()
