"""Which attention implementation a model can run with here: transformers' family flags, the
device and the packages a kernel needs (the doctor's `attention` check, before any model loads)."""

from __future__ import annotations

import importlib.util

import torch

# The attention implementations a run can take, the family flag that says transformers has it for
# a model, and what else it needs; others (kernels from the hub) need a download, which runs offline
# cannot make.
ATTENTION = {
    "sdpa": ("_supports_sdpa", None),
    "eager": (None, None),
    "flex_attention": ("_supports_flex_attn", None),
    "flash_attention_2": ("_supports_flash_attn", "flash_attn"),
    "flash_attention_3": ("_supports_flash_attn", "flash_attn_interface"),
}


def attention_problem(block, device: torch.device, family) -> str | None:
    """Why `block.attn_implementation` cannot run here, in words; None when it can (or when the
    family is unknown: loading says what is wrong)."""
    name = block.attn_implementation
    if name not in ATTENTION:
        return f"{name!r} is not one of {', '.join(ATTENTION)}"
    flag, package = ATTENTION[name]
    if package is not None and (device.type != "cuda" or importlib.util.find_spec(package) is None):
        return f"{name} needs a CUDA GPU and the {package} package"
    if family is not None and flag is not None and not getattr(family, flag, False):
        return f"transformers has no {name} for {family.__name__}"
    return None
