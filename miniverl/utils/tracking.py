"""The metric trackers of `trainer.logger` beyond the console and metrics.jsonl (verl's
utils/tracking.py): tensorboard and wandb, each given every update's metrics at its update number.

    tracking = Tracking(cfg.trainer, run_dir)   # checks the packages, opens nothing
    tracking.start(config, continuing)          # by the command, once set up (the doctor never does)
    tracking.log(metrics, step)
    tracking.finish(failed)
"""

from __future__ import annotations

import importlib
import secrets
from pathlib import Path

from miniverl.config.trainer import TrainerConfig
from miniverl.utils.errors import MiniverlError
from miniverl.utils.run_folder import atomic_write_bytes
from miniverl.utils.run_names import TENSORBOARD, WANDB, WANDB_RUN_ID


def installed(module: str, logger: str):
    """The tracker's package, imported; one not installed is the line that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MiniverlError(
            f"trainer.logger includes {logger}, which is not installed: pip install -e '.[{logger}]' (or drop it "
            "from trainer.logger)"
        ) from None


class TensorBoardLogger:
    """`trainer.logger=[...,tensorboard]`: every numeric metric as a scalar under <run>/tensorboard."""

    def __init__(self, root: Path):
        self.writer_class = installed("torch.utils.tensorboard", "tensorboard").SummaryWriter
        self.root, self.writer = root, None

    def start(self, project: str, name: str, config: dict, continuing: bool) -> None:
        self.writer = self.writer_class(log_dir=str(self.root / TENSORBOARD))  # a resumed run adds an event file

    def log(self, metrics: dict, step: int) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, failed: bool) -> None:
        self.writer.close()


class WandbLogger:
    """`trainer.logger=[...,wandb]`: a Weights & Biases run named as verl names it (project_name,
    experiment_name, the resolved config), its files under <run>/wandb. A run resumed in its own folder
    goes on in the same W&B run (its id is kept in the folder); any other run is a new one. wandb's own
    settings apply: `wandb login` first, or WANDB_MODE=offline (synced later with `wandb sync`)."""

    def __init__(self, root: Path):
        self.wandb, self.root, self.run = installed("wandb", "wandb"), root, None

    def start(self, project: str, name: str, config: dict, continuing: bool) -> None:
        id_file, folder = self.root / WANDB_RUN_ID, self.root / WANDB
        run_id = id_file.read_text().strip() if continuing and id_file.is_file() else secrets.token_hex(4)
        made = not folder.exists()
        folder.mkdir(exist_ok=True)  # wandb writes its files in <dir>/wandb, and warns where <dir> is missing
        try:
            self.run = self.wandb.init(
                project=project, name=name, config=config, dir=str(self.root), id=run_id, resume="allow"
            )
        except self.wandb.errors.Error as error:  # no API key, no network, a bad entity: wandb's own words
            said = str(error).strip().splitlines()[0].rstrip(".")
            raise MiniverlError(
                f"wandb could not start a run: {said}; run `wandb login`, or set WANDB_MODE=offline (and `wandb "
                "sync` later), or drop wandb from trainer.logger"
            ) from None
        if getattr(self.run, "disabled", False):  # WANDB_MODE=disabled (the resume check's runs): nothing to keep
            if made and not any(folder.iterdir()):
                folder.rmdir()
        else:
            atomic_write_bytes(id_file, (run_id + "\n").encode())

    def log(self, metrics: dict, step: int) -> None:
        # A step at or below one the W&B run holds (an update logged again after a resume) is dropped by
        # wandb with a warning: a resumed run logs the same values again (exact resume).
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


BACKENDS = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger}


class Tracking:
    """The trackers trainer.logger names (console and jsonl are the controller's own); each package is
    imported at once, so a missing one is refused before any model loads."""

    def __init__(self, trainer: TrainerConfig, root: Path):
        self.backends = [BACKENDS[name](root) for name in trainer.logger if name in BACKENDS]
        self.project, self.name, self.started = trainer.project_name, trainer.experiment_name, False

    def start(self, config: dict, continuing: bool) -> None:
        """Open each tracker's run: `config` the resolved config; `continuing`, a run resumed in its own folder."""
        for backend in self.backends:
            backend.start(self.project, self.name, config, continuing)
        self.started = True

    def log(self, metrics: dict, step: int) -> None:
        for backend in self.backends:
            backend.log(metrics, step)

    def finish(self, failed: bool) -> None:
        """Close what start opened (once: a report rebuilt after the resume check finds them closed)."""
        if self.started:
            for backend in self.backends:
                backend.finish(failed)
        self.started = False
