"""Schema of `conf/hardware/`: where the run executes and how work is split on that device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class HardwareConfig:
    name: str = "auto"
    device: str = "auto"  # auto = CUDA when present, else the CPU
    # Rows per rollout forward (the "physical" batch of a logical batch).
    rollout_physical_batch: int = 4
    # Rows per actor forward/backward (verl: ppo_micro_batch_size_per_gpu); gradients accumulate.
    update_chunk: int = 4
    # Positions per chunk when turning hidden states into sampled-token log-probs, so that no
    # (B, T, V) float32 tensor is ever materialised at once.
    logprob_chunk: int = 256
    deterministic: bool = True  # deterministic kernels where the device offers them
    # Resource contract of this hardware option (null: no limit).
    gpu_hour_limit: Optional[float] = None
    peak_reserved_limit_gib: Optional[float] = None
    # Fault injection for tests: a forward of more rows than this raises torch.OutOfMemoryError,
    # exercising the out-of-memory downshift (null: off).
    simulate_oom_above_rows: Optional[int] = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"hardware.device={self.device!r}; choose one of {', '.join(DEVICES)}")
        for key in ("rollout_physical_batch", "update_chunk", "logprob_chunk"):
            if getattr(self, key) < 1:
                raise ValueError(f"hardware.{key} must be >= 1")
