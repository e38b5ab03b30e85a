"""PEFT adapters beyond the fresh LoRA: a student started from an adapter folder, a teacher adapter
on a separate teacher model, and a teacher adapter sharing the student's base (`shared_base`).

An adapter folder is read only as `adapter_config.json` + `adapter_model.safetensors` (no
pickle). One that does not fit its base (other architecture, shapes or target modules) is
refused with one line naming the setting.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from miniverl.config.model import ALL_LINEAR
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import model_folder_digest, sha256_file
from miniverl.utils.overrides import hydra_value
from miniverl.utils.run_names import ADAPTER, STATE

log = logging.getLogger(__name__)

WEIGHTS = "adapter_model.safetensors"
TEACHER_ADAPTER = "teacher"  # the shared_base teacher's adapter name; the student's is "default"


def check_folder(path: str, where: str) -> Path:
    folder = Path(path)
    if not (folder / "adapter_config.json").is_file():
        hint = ""
        if (folder / ADAPTER / "adapter_config.json").is_file():  # a run folder
            hint = f"; a run's adapter is its peft_adapter/: {where}={folder / 'peft_adapter'}"
        elif (folder / "adapter.safetensors").is_file() and (folder / STATE).is_file():  # a checkpoint
            hint = f"; a checkpoint goes on with trainer.resume_from={folder}, its run's adapter is in peft_adapter/"
        raise MiniverlError(f"{where}={path}: not a PEFT adapter folder (no adapter_config.json){hint}")
    if not (folder / WEIGHTS).is_file():
        raise MiniverlError(f"{where}={path}: no {WEIGHTS} (miniverl reads adapters from safetensors only)")
    return folder


def adapter_sha256(path: str | None) -> str | None:
    return sha256_file(Path(path) / WEIGHTS) if path else None


def absent_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The target module names that match no module of `model` as peft matches them: the whole
    name, or its last dotted parts (`q_proj`, `self_attn.q_proj`)."""
    names = [name for name, _ in model.named_modules()]
    return [t for t in targets if not any(name == t or name.endswith("." + t) for name in names)]


def targets_problem(model: PreTrainedModel, targets: list[str]) -> str | None:
    """The one line for LoRA target names that no layer of `model` has: peft adapts whatever names
    match and says nothing of the rest (Phi-3 has qkv_proj, not q_proj)."""
    absent = absent_targets(model, targets)
    if not absent:
        return None
    return (
        f"model.lora.target_modules: no layer of {type(model).__name__} is named {', '.join(absent)} "
        f"(its linear layers: {', '.join(linear_layer_names(model))}); list those, "
        "or set model.lora.target_modules=all-linear"
    )


def linear_layer_names(model: PreTrainedModel) -> list[str]:
    """The distinct last names of the layers peft's all-linear adapts, in model order: linear ones
    (4-bit ones included) and GPT-2's Conv1D, the output layer left out."""
    output = model.get_output_embeddings()
    found = (
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not output
    )
    return list(dict.fromkeys(found))


def unadapted_layers(model: PreTrainedModel, targets) -> list[str]:
    """The linear layers of the wrapped `model` that LoRA's `targets` name (all-linear: every one but the
    output layer) and peft left plain. peft 0.21 maps gate_proj/up_proj/down_proj of a mixture of experts
    onto the experts' 3-D parameters (target_parameters) and drops them from target_modules, so the dense
    layers and shared experts of the same names (DeepSeek-V3's, GLM-4-MoE's, Qwen3-Next's) stay
    untrained, and it says nothing."""
    output = model.get_output_embeddings()
    wrapped = {name for name, module in model.named_modules() if hasattr(module, "base_layer")}  # peft's LoRA layers
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Linear, Conv1D))
        and module is not output
        and name not in wrapped
        and name.rsplit(".", 1)[0] not in wrapped  # a wrapped layer's own base_layer, lora_A and lora_B
        and name.rsplit(".", 2)[0] not in wrapped  # (lora_A.default: the adapter's name below it)
        and (targets == ALL_LINEAR or name.rsplit(".", 1)[-1] in targets)
    ]


def routers_problem(model: PreTrainedModel, targets) -> str | None:
    """The one line for LoRA targets that take a MoE router (Phi-3.5-MoE's, Llama 4's) or another layer LoRA
    cannot wrap: a linear layer of the model's own class whose forward returns other than the (rows,
    out_features) tensor of a plain one (a router's tuple, DeepSeek-V4's grouped output), which peft wraps
    (all-linear too) and which then fails in the first forward; None where no target is one. One that
    returns that tensor (Falcon's FalconLinear) peft wraps as any."""
    unwrappable = {}  # each such class, asked once
    routers = {}
    for name, module in model.named_modules():
        kind = type(module)
        if (
            isinstance(module, torch.nn.Linear)
            and kind.__module__.startswith("transformers.models.")
            and kind.forward is not torch.nn.Linear.forward
        ):
            if kind not in unwrappable:
                out = _forward_of_zeros(module)
                unwrappable[kind] = not (isinstance(out, torch.Tensor) and out.shape == (2, module.out_features))
            if unwrappable[kind]:
                routers[name.rsplit(".", 1)[-1]] = kind.__name__
    taken = {name: kind for name, kind in routers.items() if targets == ALL_LINEAR or name in targets}
    if not taken:
        return None
    listed = linear_layer_names(model) if targets == ALL_LINEAR else targets  # the names asked for, but routers
    kept = ",".join(name for name in listed if name not in routers)
    return (
        f"model.lora.target_modules={hydra_value(targets)}: "
        f"{', '.join(f'{name} ({kind})' for name, kind in taken.items())} returns other than the "
        f"(rows, out_features) tensor of a linear layer (a MoE router's tuple), which LoRA cannot wrap; "
        f"set model.lora.target_modules=[{kept}]"
    )


def _forward_of_zeros(module: torch.nn.Linear):
    """The layer's forward of two zero rows, in eval mode and under the global generators' state as it
    was (a router may draw jitter); what a forward that does not take them raises, it returns."""
    weight = module.weight
    training = module.training
    module.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[weight.device] if weight.device.type == "cuda" else []):
            return module(torch.zeros(2, module.in_features, dtype=weight.dtype, device=weight.device))
    except Exception as error:  # noqa: BLE001 - a forward of its own: whatever it refuses, it is not a plain layer
        return error
    finally:
        module.train(training)


def same_model(a: str, b: str) -> bool:
    """Two model names for one base: the same name, or two local folders of the same files (a copy, a toy
    built again from the same seed)."""
    if a == b:
        return True
    folders = [Path(name).expanduser() for name in (a, b)]
    return all(f.is_dir() for f in folders) and model_folder_digest(folders[0]) == model_folder_digest(folders[1])


def check_fits(model: PreTrainedModel, folder: Path, where: str) -> None:
    """Refuse an adapter whose target modules or tensor shapes do not exist in `model`."""
    config = json.loads((folder / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA":
        raise MiniverlError(f"{where}={folder}: a {config.get('peft_type')} adapter; miniverl uses LoRA adapters")
    if config.get("use_dora"):  # a magnitude vector per layer: another forward than the LoRA paths compute
        raise MiniverlError(
            f"{where}={folder}: a DoRA adapter (use_dora); miniverl computes plain LoRA: merge it into its base "
            "(PeftModel.merge_and_unload) and give that as the model"
        )
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    missing = absent_targets(model, targets)
    if missing:
        raise MiniverlError(
            f"{where}={folder}: targets modules {missing} that the base model "
            f"({type(model).__name__}) does not have; it was trained for another architecture"
        )
    shapes = dict(model.named_modules())
    with safe_open(str(folder / WEIGHTS), "pt") as tensors:
        for key in tensors.keys():
            # base_model.model.<module path>.lora_A.weight -> the layer being adapted; beside LoRA's own, a whole
            # layer saved with it (<path>.base_layer.weight: an adapted embedding or output layer; modules_to_save)
            name = key.removeprefix("base_model.model.")
            path = name.split(".lora_")[0] if ".lora_" in name else name.rsplit(".", 1)[0].removesuffix(".base_layer")
            layer = shapes.get(path) or shapes.get(path + ".base_layer")
            if layer is None:
                raise MiniverlError(f"{where}={folder}: adapts {path}, which the base model does not have")
            if ".lora_A." not in name and ".lora_B." not in name:  # an embedding's LoRA, a saved layer: no shape here
                continue
            rows, cols = tensors.get_slice(key).get_shape()
            expected = getattr(layer, "in_features", None) if ".lora_A" in key else getattr(layer, "out_features", None)
            actual = cols if ".lora_A" in key else rows
            if expected is not None and actual != expected:
                raise MiniverlError(
                    f"{where}={folder}: {path} has {expected} features in this base model but "
                    f"{actual} in the adapter; it was trained on another base model"
                )
    # Only once the shapes fit: a refused adapter was first told that they did.
    trained_on, here = config.get("base_model_name_or_path"), getattr(model, "name_or_path", None)
    if trained_on and here and not same_model(trained_on, here):  # shapes can fit another base of the family
        log.warning(
            "%s=%s was trained on %s (its adapter_config.json), not on this base, %s: its shapes fit, "
            "its weights were learnt for other ones",
            where,
            folder,
            trained_on,
            here,
        )


def lora_settings(path: str) -> dict:
    """An adapter folder's LoRA settings under model.lora's names (what a student started from it trains)."""
    config = json.loads((Path(path) / "adapter_config.json").read_text())
    targets = config.get("target_modules")
    return {
        "r": config.get("r"),
        "alpha": config.get("lora_alpha"),
        "dropout": config.get("lora_dropout"),
        "target_modules": sorted(targets) if isinstance(targets, list) else targets,
        "bias": config.get("bias"),
    }


def student_from_adapter(model: PreTrainedModel, path: str) -> PeftModel:
    """model.adapter: continue training exactly the weights of an existing adapter."""
    folder = check_folder(path, "model.adapter")
    check_fits(model, folder, "model.adapter")
    lora = lora_settings(path)
    said = f"LoRA r={lora['r']} alpha={lora['alpha']} on {lora['target_modules']}"
    log.info("model.adapter: %s, from its adapter_config.json (model.lora is not read)", said)
    return PeftModel.from_pretrained(model, str(folder), is_trainable=True)


def teacher_with_adapter(model: PreTrainedModel, path: str, where: str = "teacher.adapter") -> PreTrainedModel:
    """teacher.mode=standard with teacher.adapter: the adapter applied (unmerged) on the teacher."""
    folder = check_folder(path, where)
    check_fits(model, folder, where)
    peft_teacher = PeftModel.from_pretrained(model, str(folder), is_trainable=False)
    peft_teacher.requires_grad_(False)
    return peft_teacher.get_base_model()  # LoRA layers injected in place, always active


def attach_shared_teacher(student: PeftModel, path: str, where: str = "teacher") -> None:
    """teacher.mode=shared_base: the teacher adapter joins the student's base as a frozen second
    adapter (`where`: the teacher's config path; one shared_base teacher per run)."""
    folder = check_folder(path, f"{where}.adapter")
    check_fits(student.get_base_model(), folder, f"{where}.adapter")
    student.load_adapter(str(folder), adapter_name=TEACHER_ADAPTER, is_trainable=False)
    student.set_adapter("default")  # the student's own adapter stays the active, trainable one


def shared_teacher_bytes(student: PeftModel) -> int:
    """Bytes of the shared_base teacher's adapter weights (all that teacher adds to memory)."""
    marker = f".{TEACHER_ADAPTER}."  # lora_A.teacher.weight
    return sum(p.numel() * p.element_size() for name, p in student.named_parameters() if marker in name)


def teacher_adapter_switch(student: PeftModel, mode: str) -> Callable[[], ContextManager]:
    """What must hold around a teacher forward that runs on the student's own base model."""
    if mode == "ref":
        return student.disable_adapter

    @contextmanager
    def teacher_adapter_active():
        student.set_adapter(TEACHER_ADAPTER, inference_mode=True)
        try:
            yield
        finally:
            student.set_adapter("default")  # trainable again

    return teacher_adapter_active
