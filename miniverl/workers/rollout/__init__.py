"""Rollout role (verl: `generate_sequences`): the student samples responses (worker.py), one
sampling stream per sample (sampling.py), over the decode fast paths of lean_decode.py and, on CPUs
with bf16 instructions, the products prepared for the decode step of cpu_products.py."""

from miniverl.workers.rollout.worker import RolloutWorker

__all__ = ["RolloutWorker"]
