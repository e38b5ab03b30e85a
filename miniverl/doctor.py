"""Pre-flight checks: `python -m miniverl.doctor +recipe=<name> [overrides]`.

Before hours of GPU time, check that the teacher and the student can be distilled at all: one line
per check, PASS / WARN / FAIL with the reason (miniverl/trainer/preflight.py says what each checks);
any FAIL makes the exit code 1. The training command (`miniverl.main`) runs the cheap ones (data,
tokenizer, memory) first and stops on a FAIL. It writes nothing into outputs/: what the checks build
goes to a temporary folder, or with `--out DIR` to DIR.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from miniverl.config import MiniverlConfig, to_config
from miniverl.config.export import EXPORT_FOLDER
from miniverl.utils.errors import MiniverlError, ctrl_c_stop, exit_code_of
from miniverl.utils.hydra_entry import first_override_at, one_line_hydra_errors, run_as_main
from miniverl.utils.overrides import override_key
from miniverl.utils.run_names import ADAPTER, CHECKPOINTS, METRICS, REPORT, TOY_MODELS, TRAJECTORIES
from miniverl.verl_compat.field_rules import verl_key_hints

MODEL_CHECKS = ("self-test", "nf4-gradients")  # after the three cheap ones, with the models loaded


def run_checks(cfg: MiniverlConfig, run_dir: Path) -> list:
    """Every check, in order (trainer.preflight.Check each); the model checks only if the cheap pass."""
    # Imported here, after the config composed: a mistake in it is reported without loading torch.
    from miniverl.models import loading as models
    from miniverl.trainer.model_checks import check_nf4_gradients, check_self_test
    from miniverl.trainer.opd_trainer import OPDTrainer
    from miniverl.trainer.preflight import cheap_checks, guarded
    from miniverl.utils.device import resolve_device

    device = resolve_device(cfg.hardware)
    checks = cheap_checks(cfg, device)
    if any(c.status == "FAIL" for c in checks):
        return checks
    trainer = OPDTrainer(cfg, {}, run_dir)
    trainer.setup()
    checks.append(guarded(MODEL_CHECKS[0], check_self_test, trainer))
    source = models.source_of(cfg.model, trainer.run_dir / TOY_MODELS / "student")
    checks.append(guarded(MODEL_CHECKS[1], check_nf4_gradients, trainer, source))
    return checks


@one_line_hydra_errors(verl_hints=verl_key_hints)
@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def doctor_app(cfg: DictConfig) -> None:
    try:
        try:
            checks = run_checks(to_config(cfg), Path(HydraConfig.get().runtime.output_dir))
        except KeyboardInterrupt:
            raise ctrl_c_stop("stopped by SIGINT before the last check") from None
    except MiniverlError as error:
        sys.exit(exit_code_of(error))
    for check in checks:
        print(check, flush=True)
    failed = [c.name for c in checks if c.status == "FAIL"]
    skipped = [name for name in MODEL_CHECKS if name not in {c.name for c in checks}]
    tail = f"; not run after the FAIL: {', '.join(skipped)} (they load the models)" if skipped else ""
    print(f"doctor: {len(checks) - len(failed)}/{len(checks)} checks without FAIL{tail}")
    sys.exit(1 if failed else 0)


# What a training run or an export leaves in its folder: the doctor builds beside none of them (its setup would
# take trainer.overwrite=true as leave to empty a run's folder, and it would replace .hydra/). plan.json is not
# among them: the doctor writes one itself, and runs again in its own --out.
NOT_THE_DOCTORS = (REPORT, METRICS, CHECKPOINTS, ADAPTER, TRAJECTORIES, EXPORT_FOLDER)


def refuse_out(out: Path) -> None:
    """--out: a folder the doctor can write, holding no training run or export (one line otherwise)."""
    from miniverl.utils.run_folder import holds  # a file, or a folder with something in it (not an empty one)

    held = [name for name in NOT_THE_DOCTORS if holds(out / name)]
    if held:
        sys.exit(exit_code_of(MiniverlError(
            f"--out {out} holds a training run's or an export's files ({', '.join(held)}): the doctor never "
            "replaces them; give a new or empty folder"
        )))  # fmt: skip
    if out.exists() and not out.is_dir():
        sys.exit(exit_code_of(MiniverlError(f"--out {out} is a file, not a folder; choose another --out")))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file in the way (FileExistsError, NotADirectoryError), a read-only place
        sys.exit(exit_code_of(MiniverlError(f"cannot write --out {out}: {error.strerror}; choose another --out")))


def main() -> None:
    """`--out DIR` keeps what the checks build (plan.json, toy models, Hydra's .hydra/) in DIR;
    without it they go to a temporary folder that is removed, and outputs/ is left alone."""
    argv = [part for arg in sys.argv[1:] for part in (arg.split("=", 1) if arg.startswith("--out=") else [arg])]
    out = None
    if "--out" in argv:
        at = argv.index("--out")
        if at + 1 >= len(argv):
            sys.exit(exit_code_of(MiniverlError("--out needs a folder: python -m miniverl.doctor --out DIR ...")))
        out = argv[at + 1]
        del argv[at : at + 2]
    if "-m" in argv or "--multirun" in argv:
        sweep = MiniverlError("the doctor checks one command, not a sweep: drop -m and give each key one value")
        sys.exit(exit_code_of(sweep))
    if out is not None:
        refuse_out(Path(out))
    # The training command's own folder, copied along with its overrides: what the checks build
    # (plan.json) would make that folder look like a run's and refuse the training that follows.
    run_dirs = [a for a in argv if override_key(a) == "hydra.run.dir"]
    if run_dirs:
        print(f"doctor: {run_dirs[-1]} left out: the checks build in a temporary folder (--out DIR keeps them)")
        argv = [a for a in argv if a not in run_dirs]
    with tempfile.TemporaryDirectory(prefix="miniverl-doctor-") as scratch:
        folder = ["hydra.run.dir=" + (out or scratch)]
        if out is None:  # nothing of Hydra's either: no .hydra/ and no doctor.log
            folder += ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
        # Among the user's overrides: Hydra's parser refuses overrides on both sides of a flag (-cd DIR, --cfg job).
        at = first_override_at(argv)
        sys.argv = [sys.argv[0], *argv[:at], *folder, *argv[at:]]
        doctor_app()


def cli() -> None:
    """The console script: runs this module as `python -m miniverl.doctor` does."""
    run_as_main("miniverl.doctor")


if __name__ == "__main__":
    main()
