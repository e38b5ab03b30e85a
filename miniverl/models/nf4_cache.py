"""NF4 weights quantized once per machine (`hardware.nf4_cache`).

Every start used to quantize the bf16 checkpoints to NF4 again: bitsandbytes' quantization is most of
loading a model on the CPU (SmolLM2-135M-Instruct: 2.7 s of loading, 0.2 s of it reading the saved
NF4 weights back; scaling with the weights). The first load of a model folder saves the quantized
model (transformers' own 4-bit serialization, safetensors) into `$MINIVERL_CACHE/nf4/`; later loads
read it back and quantize nothing. The same bits: the quantization is deterministic, and the entry's
key holds everything that decides it — the source folder's files (utils/identity.model_folder_digest,
the plan's own notion of "the same model folder", and each file's size and modification time, so
that an edit in place the digest's samples miss still makes another entry), the quantization
settings and compute dtype, and the kernel environment (device, CPU ISA, GPU, package releases:
utils/numerics, threads left out — a block's absolute maximum and its nearest NF4 level do not
depend on how the work is split).

Writing an entry removes the source's entries of other weights (the folder was saved again: their
weights are gone) and, after STALE_DAYS unread, entries whose local folder no longer exists (a test's
temporary model; kept meanwhile, for a disk that is only unmounted). Deleting the folder is always
safe: the next start quantizes again. Toys (built per run) and models with their own code
(`trust_remote_code`) are never cached.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache

from miniverl.config.model import cache_root
from miniverl.models.real_fixture import write_atomically
from miniverl.utils.hydra_entry import log_line
from miniverl.utils.identity import model_folder_digest, sha256_json
from miniverl.utils.numerics import numerics_environment

RECORD = "miniverl_nf4_source.json"  # in each entry: {"source": path or hub id, "weights": its files' digest}
ENTRY_NAME = re.compile(r".+-[0-9a-f]{16}")  # <source name>-<key>; a writer's staging folder has a suffix
STALE_DAYS = 7

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    folder: Path  # where the quantized model is (or will be) saved
    weights: str  # the digest of the source's files it is quantized from


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


def entry_for(path: str, revision: str | None, quantization: dict, device: torch.device) -> Entry | None:
    """The cache entry of this model's NF4 weights; None where its files are not on this machine yet."""
    folder = source_folder(path, revision)
    if folder is None:
        return None
    stamps = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(folder.iterdir()) if p.is_file()}
    weights = sha256_json([model_folder_digest(folder), stamps])
    kernels = numerics_environment(device)
    kernels.pop("torch_threads", None)
    key = sha256_json({"weights": weights, "quantization": quantization, "kernels": kernels})
    name = folder.name if Path(path).is_absolute() else path.replace("/", "--")  # a hub id: Qwen--Qwen3-0.6B
    return Entry(cache_root() / "nf4" / f"{name}-{key[:16]}", weights)


def mark_read(entry: Entry, path: str) -> None:
    """Said in the run's main.log (the console says only what a first start writes); an entry read now is
    not stale (STALE_DAYS counts from its last read)."""
    log_line(log, f"the NF4 weights of {path} read from {entry.folder} (hardware.nf4_cache)")
    try:
        os.utime(entry.folder / RECORD)
    except OSError:  # a read-only cache: nothing is removed from it either
        pass


def store(model, entry: Entry, path: str, *, replace: bool = False) -> None:
    """Save the quantized `model` as `entry` (one rename: a folder with a config.json is whole; `replace`:
    an entry that would not load is there) and remove the entries it makes obsolete. A cache that cannot
    be written (read-only, a full disk) costs the next start its quantization only."""
    try:
        if replace:
            shutil.rmtree(entry.folder, ignore_errors=True)
        record = json.dumps({"source": path, "weights": entry.weights}) + "\n"
        write_atomically(entry.folder, model, files={RECORD: record})
        _remove_obsolete(entry, path)
    except Exception as error:  # safetensors' own error on a full disk is not an OSError
        log.warning("the NF4 weights of %s were not cached in %s (%s)", path, entry.folder.parent, error)
        return
    log.info("the NF4 weights of %s are cached in %s (hardware.nf4_cache)", path, entry.folder)


def _remove_obsolete(entry: Entry, path: str) -> None:
    for other in entry.folder.parent.iterdir():
        if other == entry.folder or not ENTRY_NAME.fullmatch(other.name):
            continue
        try:
            record = json.loads((other / RECORD).read_text())
            unread_days = (time.time() - (other / RECORD).stat().st_mtime) / 86400
        except (OSError, ValueError):
            continue
        source = record.get("source") if isinstance(record, dict) else None
        if not isinstance(source, str):
            continue
        saved_again = source == path and record.get("weights") != entry.weights
        gone = Path(source).is_absolute() and not Path(source).exists() and unread_days > STALE_DAYS
        if saved_again or gone:
            shutil.rmtree(other, ignore_errors=True)
