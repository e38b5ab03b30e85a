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
