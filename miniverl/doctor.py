"""Pre-flight checks: `python -m miniverl.doctor +recipe=<name> [overrides]`.

Before hours of GPU time, check that the teacher and the student can be distilled at all: one line
per check, PASS / WARN / FAIL with the reason (miniverl/trainer/preflight.py has what each checks);
any FAIL makes the exit code 1. The training command (`miniverl.main`) runs the cheap ones (data,
tokenizer, memory) first and stops on a FAIL.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from miniverl.config import MiniverlConfig, to_config
from miniverl.models import loading as models
from miniverl.trainer.opd_trainer import OPDTrainer
from miniverl.trainer.preflight import Check, cheap_checks, check_nf4_gradients, check_self_test, guarded
from miniverl.utils.device import resolve_device
from miniverl.utils.errors import MiniverlError, exit_code_of


def run_checks(cfg: MiniverlConfig, run_dir: Path) -> list[Check]:
    device = resolve_device(cfg.hardware)
    checks = cheap_checks(cfg, device)
    if any(c.status == "FAIL" for c in checks):
        return checks
    trainer = OPDTrainer(cfg, {}, run_dir)
    trainer.setup()
    checks.append(guarded("self-test", check_self_test, trainer))
    source = models.source_of(cfg.model, trainer.run_dir / "toy_models" / "student")
    checks.append(guarded("nf4-gradients", check_nf4_gradients, trainer, source))
    return checks


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        checks = run_checks(to_config(cfg), Path(HydraConfig.get().runtime.output_dir))
    except MiniverlError as error:
        sys.exit(exit_code_of(error))
    for check in checks:
        print(check, flush=True)
    failed = [c.name for c in checks if c.status == "FAIL"]
    print(f"doctor: {len(checks) - len(failed)}/{len(checks)} checks without FAIL")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
