"""Canonical serialization and the digests built on it.

Canonical JSON: keys sorted, no whitespace, UTF-8, no NaN. Every digest in a report is the
sha256 of such bytes (or of a file's bytes), so two processes with the same inputs agree.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_json(value: Any) -> str:
    return sha256_bytes(canonical_json(value))


def sha256_file(path: str | Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def resolved_config(cfg: DictConfig) -> dict:
    """The composed config, fully interpolated, without Hydra's runtime node."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    return plain


def resolved_config_digest(cfg: DictConfig) -> str:
    return sha256_json(resolved_config(cfg))


# A model folder's digest reads whole only its small files; of each large one (weights) its size and
# FOLDER_DIGEST_BLOCKS blocks spread evenly over it, the first holding a safetensors header: a folder
# saved again with other weights changes every block, and a few MiB are read where hashing the
# weights whole would read them all again before loading them (seconds per GB).
FOLDER_DIGEST_BLOCKS = 64
FOLDER_DIGEST_BLOCK_BYTES = 1 << 16
# The key under which a model block's plan settings hold its local folders' digests (trainer/plan.py).
FOLDER_DIGESTS = "folder_sha256"


def model_folder_digest(folder: str | Path) -> str:
    """sha256 over the files of a local model (or adapter, or tokenizer) folder, by name: all of a
    file up to FOLDER_DIGEST_BLOCKS blocks, else its size and blocks spread over it. Hidden files
    (a download's .cache/) and *.md pages are left out. A change confined to a few small tensors of
    a large file can escape it; a re-saved model does not."""
    digest = hashlib.sha256()
    budget = FOLDER_DIGEST_BLOCKS * FOLDER_DIGEST_BLOCK_BYTES
    for path in sorted(Path(folder).expanduser().iterdir()):
        if not path.is_file() or path.name.startswith(".") or path.suffix == ".md":
            continue
        size = path.stat().st_size
        digest.update(canonical_json([path.name, size]))
        with open(path, "rb") as handle:
            if size <= budget:
                digest.update(handle.read())
                continue
            step = (size - FOLDER_DIGEST_BLOCK_BYTES) / (FOLDER_DIGEST_BLOCKS - 1)
            for block in range(FOLDER_DIGEST_BLOCKS):
                handle.seek(round(block * step))
                digest.update(handle.read(FOLDER_DIGEST_BLOCK_BYTES))
    return digest.hexdigest()
