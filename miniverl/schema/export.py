"""Schema of `conf/export/`: the scale of the verl v0.8.0 launch that `python -m miniverl.export`
writes (not part of the compiled plan: exporting never changes a run)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExportConfig:
    nnodes: int = 1
    n_gpus_per_node: int = 1
