"""Checkpoints: `checkpoints/update_<k>/` = adapter.safetensors + optimizer.safetensors + state.json.

Safetensors and JSON only (no pickle). A checkpoint is written into a hidden temporary folder,
every file fsynced, then renamed into place, so a crash mid-write leaves the previous checkpoint
whole and the half-written one invisible. `state.json` holds the sha256 of the two tensor files
and the kernel environment that computed them; before a resume loads one, utils/resume_from.py
verifies the hashes, the plan digest, the files the resumed run needs and that this process computes
as that one did, before anything is written.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from peft.utils.constants import EMBEDDING_LAYER_NAMES
from safetensors.torch import load_file, save_file

from miniverl import __version__
from miniverl.config.trainer import TrainerConfig
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import canonical_json, sha256_file
from miniverl.utils.run_names import CHECKPOINTS, STATE, TRAJECTORIES

log = logging.getLogger(__name__)

TENSOR_FILES = ("adapter.safetensors", "optimizer.safetensors")
PREFIX = "update_"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict, dict]:
    """AdamW state as named tensors (`<param name>.<exp_avg|exp_avg_sq|step>`) and its
    hyperparameters as safetensors metadata."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    tensors = {}
    for name, param in zip(names, params):
        for key, value in optimizer.state.get(param, {}).items():
            tensors[f"{name}.{key}"] = value.detach().cpu().contiguous()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    # One metadata key: safetensors writes several keys in no fixed order, which would break the
    # byte-identity of checkpoints across processes.
    return tensors, {"optimizer": canonical_json({"param_groups": groups, "param_names": names}).decode()}


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str], tensors: dict) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for name, param in zip(names, params):
        state = {key.rsplit(".", 1)[1]: t for key, t in tensors.items() if key.rsplit(".", 1)[0] == name}
        if state:
            optimizer.state[param] = {k: v.to(param.device) if k != "step" else v for k, v in state.items()}


def save_checkpoint(
    root: Path, update: int, student: PeftModel, optimizer: torch.optim.Optimizer, param_names: list[str], state: dict
) -> Path:
    """Write checkpoints/update_<update>/ atomically; returns its path."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{update}"
    tmp = root / f".{PREFIX}{update}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crash mid-write
    tmp.mkdir()
    embeddings = embeddings_targeted(student)
    adapter = get_peft_model_state_dict(student, save_embedding_layers=embeddings)
    adapter = {k: v.detach().cpu().contiguous() for k, v in adapter.items()}
    save_file(adapter, str(tmp / "adapter.safetensors"), metadata={"format": "pt"})
    tensors, metadata = optimizer_tensors(optimizer, param_names)
    save_file(tensors, str(tmp / "optimizer.safetensors"), metadata=metadata)
    for name in TENSOR_FILES:
        with_umask_mode(tmp / name)
    files = {name: sha256_file(tmp / name) for name in TENSOR_FILES}
    (tmp / STATE).write_bytes(canonical_json({**state, "miniverl_version": __version__, "files": files}))
    for name in (*TENSOR_FILES, STATE):
        _fsync_file(tmp / name)
    _fsync_dir(tmp)
    if _holds(final, files):  # the same tensors on disk, a new state (a probe a resume owed)
        os.replace(tmp / STATE, final / STATE)  # atomic: the checkpoint stays whole throughout
        _fsync_dir(final)
        shutil.rmtree(tmp)
        return final
    if final.exists():  # re-saving the same update with other tensors (a rerun into this folder): replace whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    return final


def _holds(path: Path, files: dict[str, str]) -> bool:
    """Whether the checkpoint folder `path` holds tensor files of exactly these sha256 (hashed on
    disk, not read from its state.json: a damaged file is replaced, not kept)."""
    return all((path / name).is_file() and sha256_file(path / name) == digest for name, digest in files.items())


def is_due(update: int, trainer_config: TrainerConfig, total_updates: int) -> bool:
    """Whether a checkpoint follows `update`: every trainer.save_freq updates, at
    trainer.stop_after_updates and after the last update."""
    freq = trainer_config.save_freq
    return update in (trainer_config.stop_after_updates, total_updates) or (freq > 0 and update % freq == 0)


def embeddings_targeted(student: PeftModel) -> bool:
    """Whether the LoRA adapter wraps an embedding or the output layer, whose weights peft then
    saves whole. Given to peft explicitly: its "auto" asks the hub whether the vocabulary changed,
    which in an offline run warns at every save."""
    targets = student.peft_config["default"].target_modules or ()
    return any(name in targets for name in EMBEDDING_LAYER_NAMES)


def save_adapter(student: PeftModel, folder: Path) -> None:
    """The trained student as a standard PEFT adapter folder (adapter_config.json and
    adapter_model.safetensors), the default adapter only (not a shared_base teacher's)."""
    student.save_pretrained(
        str(folder),
        safe_serialization=True,
        selected_adapters=["default"],
        save_embedding_layers=embeddings_targeted(student),
    )
    config = Path(folder) / "adapter_config.json"
    fields = json.loads(config.read_text())
    if isinstance(fields.get("target_modules"), list):  # peft writes its set in this process's hash order
        fields["target_modules"] = sorted(fields["target_modules"])  # the same adapter, the same bytes
        config.write_text(json.dumps(fields, indent=2, sort_keys=True))  # as peft writes it
    tensors_with_umask_mode(folder)


def _process_umask() -> int:
    mask = os.umask(0)  # the one way to read it: set and restore, once, at import
    os.umask(mask)
    return mask


UMASK = _process_umask()


def with_umask_mode(path: Path) -> None:
    """safetensors writes its files 0600 (through a private temporary file of its own); give them the
    mode every other file of the run gets under the user's umask, so that an adapter or a checkpoint
    is as readable (on a shared machine) as the report beside it."""
    path.chmod(0o666 & ~UMASK)


def tensors_with_umask_mode(folder: Path) -> None:
    """with_umask_mode for every safetensors file save_pretrained wrote into `folder`."""
    for weights in folder.glob("*.safetensors"):
        with_umask_mode(weights)


def prune(run_dir: Path, keep: int | None, newest: int) -> None:
    """After checkpoint `newest` is written: delete the folder's checkpoints of later updates, then all but
    the newest `keep` (None: keep every one). A later one is left by the run an earlier checkpoint of this
    folder resumed: its trajectory is being replaced, and by its number it would pass for the newest (an
    auto resume's choice) and push this run's own checkpoints out."""
    found = checkpoints_in(run_dir)
    later = [c for c in found if checkpoint_update(c) > newest]
    if later:
        names = ", ".join(c.name for c in later)
        log.warning("removed %s: later updates of the run this one resumed at an earlier update (replaced)", names)
    ours = [c for c in found if checkpoint_update(c) <= newest]
    for old in later + (ours[:-keep] if keep is not None else []):
        shutil.rmtree(old)


def checkpoint_update(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


def checkpoints_in(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run folder, oldest first."""
    root = run_dir / CHECKPOINTS
    found = (
        [p for p in root.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX) :].isdigit()] if root.is_dir() else []
    )
    return sorted(found, key=checkpoint_update)


@dataclass
class Checkpoint:
    path: Path
    state: dict
    # How this process computes otherwise than the one that wrote it, where trainer.resume_inexact let
    # it resume anyway ("torch_threads 2 -> 1", ...); empty: the resume goes on byte for byte.
    numerics_changes: list[str] = field(default_factory=list)

    @property
    def update(self) -> int:
        return int(self.state["global_optimizer_steps"])

    @property
    def run_dir(self) -> Path:
        return self.path.parent.parent

    @property
    def inexact_because(self) -> list[str]:
        """Every way the run so far computed otherwise than one uninterrupted process would: the earlier
        resumes' (kept in the checkpoint's state) and this one's."""
        return [*self.state.get("inexact_because", []), *self.numerics_changes]


def trajectory_path(run_dir: Path, update: int) -> Path:
    return run_dir / TRAJECTORIES / f"update_{update:06d}.safetensors"


def restore(
    checkpoint: Checkpoint, student: PeftModel, optimizer: torch.optim.Optimizer, param_names: list[str]
) -> None:
    adapter = load_file(str(checkpoint.path / "adapter.safetensors"))
    result = set_peft_model_state_dict(student, adapter)
    if getattr(result, "unexpected_keys", None):
        raise MiniverlError(
            f"trainer.resume_from: adapter of {checkpoint.path} does not fit this model "
            f"(unexpected {result.unexpected_keys[:3]})"
        )
    load_optimizer_tensors(optimizer, param_names, load_file(str(checkpoint.path / "optimizer.safetensors")))
    later = [update for update in unfinished_updates(checkpoint.run_dir) if update > checkpoint.update]
    if later:  # a later checkpoint cut short mid-write stays hidden: say what the resume goes on from
        log.warning(
            "%s: the checkpoint of update %d was cut short while it was written (its run stopped then): resuming "
            "from update %d, the last whole one",
            checkpoint.run_dir / CHECKPOINTS,
            later[-1],
            checkpoint.update,
        )


def unfinished_updates(run_dir: Path) -> list[int]:
    """The updates whose checkpoint's writing was cut short (their hidden `.update_<k>.tmp` folders), in order."""
    root = run_dir / CHECKPOINTS
    names = [p.name[len(PREFIX) + 1 : -len(".tmp")] for p in root.glob(f".{PREFIX}*.tmp")] if root.is_dir() else []
    return sorted(int(name) for name in names if name.isdigit())
