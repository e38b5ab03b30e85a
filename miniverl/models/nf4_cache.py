"""NF4 weights quantized once per machine (`hardware.nf4_cache`).

Every start used to quantize the bf16 checkpoints to NF4 again: bitsandbytes' quantization is most of
loading a model on the CPU (SmolLM2-135M-Instruct: 2.7 s of loading, 0.2 s of it reading the saved
NF4 weights back; scaling with the weights). The first load of a model folder saves the quantized
model (transformers' own 4-bit serialization, safetensors) into `$MINIVERL_CACHE/nf4/`; later loads
read it back and quantize nothing. The same bits: the quantization is deterministic, and the entry's
key holds everything that decides it — the folder's content digest (utils/identity.model_folder_digest,
the plan's own notion of "the same model folder"), the quantization settings and compute dtype, and the
kernel environment (device, CPU ISA, GPU, package releases: utils/numerics, threads left out — a block's
absolute maximum and its nearest NF4 level do not depend on how the work is split).

One entry per source: writing a new one (the folder saved again, a package upgraded) removes the
source's older entries and those of local folders that no longer exist. Deleting the folder is always
safe: the next start quantizes again. Toys (built per run) and models with their own code
(`trust_remote_code`) are never cached.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache

from miniverl.config.model import cache_root
from miniverl.models.real_fixture import write_atomically
from miniverl.utils.identity import model_folder_digest, sha256_json
from miniverl.utils.numerics import numerics_environment

RECORD = "miniverl_nf4_source.json"  # in each entry: the source it was quantized from


def source_folder(path: str, revision: str | None) -> Path | None:
    """The local folder of a model's files: the folder itself, or a hub model's downloaded snapshot
    (None: not downloaded yet, or not a model folder)."""
    folder = Path(path)
    if folder.is_dir():
        return folder
    try:
        config = try_to_load_from_cache(path, "config.json", revision=revision)
    except ValueError:  # not a hub id either (loading says what)
        return None
    return Path(config).parent if isinstance(config, str) else None


def entry_for(path: str, revision: str | None, quantization: dict, device: torch.device) -> Path | None:
    """The cache folder this model's NF4 weights are (or will be) saved in; None where its files are not
    on this machine yet."""
    folder = source_folder(path, revision)
    if folder is None:
        return None
    kernels = numerics_environment(device)
    kernels.pop("torch_threads", None)
    key = sha256_json({"weights": model_folder_digest(folder), "quantization": quantization, "kernels": kernels})
    return cache_root() / "nf4" / f"{folder.name}-{key[:16]}"


def store(model, entry: Path, path: str) -> None:
    """Save the quantized `model` as `entry` (one rename: a folder with a config.json is whole) and remove
    the entries it replaces. A cache that cannot be written costs the next start its quantization only."""
    try:
        write_atomically(entry, model, files={RECORD: json.dumps({"source": path}) + "\n"})
        _remove_replaced(entry, path)
    except OSError as error:
        print(f"miniverl: the NF4 weights of {path} were not cached in {entry.parent} ({error})", file=sys.stderr)
        return
    print(f"miniverl: the NF4 weights of {path} are cached in {entry} (hardware.nf4_cache)", file=sys.stderr)


def _remove_replaced(entry: Path, path: str) -> None:
    for other in entry.parent.iterdir():
        if other == entry or not (other / RECORD).is_file():
            continue
        try:
            source = json.loads((other / RECORD).read_text())["source"]
        except (OSError, ValueError, KeyError):
            continue
        if source == path or (Path(source).is_absolute() and not Path(source).exists()):
            shutil.rmtree(other, ignore_errors=True)


def discard(entry: Path) -> None:
    """An entry that would not load (damaged by hand, a package's format changed): quantized again."""
    shutil.rmtree(entry, ignore_errors=True)
