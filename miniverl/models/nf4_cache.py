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

Every read checks the entry's files against the sha256 recorded when they were written (a file
damaged in place can still load, as other numbers); an entry that does not check or load is quantized
again from the source and replaced. Writing an entry removes the source's entries of other weights (the
folder was saved again) or of other package releases, after STALE_DAYS unread the entries whose local
folder no longer exists (a test's temporary model; kept meanwhile, for a disk that is only unmounted),
and the staging folder of a writer killed a day ago. Deleting the folder is always safe: the next start
quantizes again. Toys (built per run), models with their own code (`trust_remote_code`) and checkpoints
already in 4 bits are never cached.
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
from miniverl.utils.identity import model_folder_digest, sha256_file, sha256_json
from miniverl.utils.numerics import NUMERICS_PACKAGES, numerics_environment

# In each entry: its source (a path or a hub id), the digest of the source's files, the package releases
# that quantized it, and the sha256 of each file of the entry.
RECORD = "miniverl_nf4_source.json"
ENTRY_NAME = re.compile(r".+-[0-9a-f]{16}")  # <source name>-<key>
STAGING_NAME = re.compile(r".+-[0-9a-f]{16}\..+")  # write_atomically's folder before its rename
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
    """The cache entry of the NF4 weights loading quantizes for this model (never for one saved quantized
    already: that loads as saved, models/loading.py); None where its files are not on this machine yet."""
    folder = source_folder(path, revision)
    if folder is None:
        return None
    files = [p for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".") and p.suffix != ".md"]
    stamps = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}  # those model_folder_digest reads
    weights = sha256_json([model_folder_digest(folder), stamps])
    key = sha256_json({"weights": weights, "quantization": quantization, "kernels": _kernels(device)})
    name = folder.name if Path(path).is_absolute() else path.replace("/", "--")  # a hub id: Qwen--Qwen3-0.6B
    return Entry(cache_root() / "nf4" / f"{name}-{key[:16]}", weights)


def saved_quantization(folder: Path) -> dict | None:
    """The quantization_config a model folder's config.json was saved with (a `-bnb-4bit` repository's);
    None for full-precision weights."""
    saved = _json(folder / "config.json").get("quantization_config")
    return saved if isinstance(saved, dict) else None


def _kernels(device: torch.device) -> dict:
    kernels = numerics_environment(device)
    kernels.pop("torch_threads", None)
    return kernels


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _file_digests(folder: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != RECORD}


def whole(entry: Entry) -> bool:
    """Whether the entry's files are the bytes written (a file damaged in place may still load, as
    other numbers: checked on every read, ~0.1 s per 100 MB)."""
    recorded = _json(entry.folder / RECORD).get("files")
    return isinstance(recorded, dict) and recorded == _file_digests(entry.folder)


def mark_read(entry: Entry, path: str) -> None:
    """Said in the run's main.log (the console says only what a first start writes); an entry read now is
    not stale (STALE_DAYS counts from its last read)."""
    log_line(log, f"the NF4 weights of {path} read from {entry.folder} (hardware.nf4_cache)")
    try:
        os.utime(entry.folder / RECORD)
    except OSError:  # a read-only cache: nothing is removed from it either
        pass


def store(model, entry: Entry, path: str, device: torch.device, *, replace: bool = False) -> None:
    """Save the quantized `model` as `entry` (one rename: a folder with a config.json is whole; `replace`:
    an entry that did not check or load is there) and remove the entries it makes obsolete. A cache that cannot
    be written (read-only, a full disk) costs the next start its quantization only."""
    packages = {k: v for k, v in _kernels(device).items() if k in NUMERICS_PACKAGES}

    def record(staging: Path) -> str:
        fields = {"source": path, "weights": entry.weights, "packages": packages, "files": _file_digests(staging)}
        return json.dumps(fields, indent=1) + "\n"

    try:
        if replace:
            shutil.rmtree(entry.folder, ignore_errors=True)
        write_atomically(entry.folder, model, files={RECORD: record})
        _remove_obsolete(entry, path, packages)
    except Exception as error:  # safetensors' own error on a full disk is not an OSError
        said = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        log.warning("the NF4 weights of %s were not cached in %s (%s)", path, entry.folder.parent, said)
        return
    log.info("the NF4 weights of %s are cached in %s (hardware.nf4_cache)", path, entry.folder)


def _remove_obsolete(entry: Entry, path: str, packages: dict) -> None:
    """The source's entries of other weights or package releases (no start reads them again, but one
    that goes back), those of local folders gone for STALE_DAYS unread, and staging folders a killed
    writer left a day ago."""
    for other in entry.folder.parent.iterdir():
        if not ENTRY_NAME.fullmatch(other.name):
            if STAGING_NAME.fullmatch(other.name) and (_age_days(other) or 0) > 1:
                shutil.rmtree(other, ignore_errors=True)
            continue
        record, age_days = _json(other / RECORD), _age_days(other / RECORD)
        source = record.get("source")
        if other == entry.folder or not isinstance(source, str) or age_days is None:
            continue
        replaced = source == path and (record.get("weights"), record.get("packages")) != (entry.weights, packages)
        gone = Path(source).is_absolute() and not Path(source).exists() and age_days > STALE_DAYS
        if replaced or gone:
            shutil.rmtree(other, ignore_errors=True)


def _age_days(path: Path) -> float | None:
    try:
        return (time.time() - path.stat().st_mtime) / 86400
    except OSError:
        return None
