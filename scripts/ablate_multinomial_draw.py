"""Ablation (docs/learning.md): train with `torch.multinomial` drawing the rollout's tokens instead
of miniverl's inverse-CDF streams; everything else as shipped, the held-out probe unchanged.

    python scripts/ablate_multinomial_draw.py +recipe=opd_k1_real_cpu recipe.optimizer_updates=16 \\
        eval.every=8 recipe.interrupt_after_updates=null trainer.seed=S

Each training row draws from its own generator, seeded from the uniform its own stream gives at
that position, so the run stays deterministic; the probe keeps the shipped sampler, so every run's
held-out KL is measured on the same sample paths. Both are exact samplers of the same distribution:
what differs is which tokens are drawn.
"""

from __future__ import annotations

import runpy

import torch
from shipped_probe import probing  # the probe keeps the shipped sampler

import miniverl.workers.rollout.worker as rollout_worker

SHIPPED = rollout_worker.sample_token


def multinomial_token(logits: torch.Tensor, u: torch.Tensor, *, top_k: int = -1, top_p: float = 1.0):
    """(b, V) logits, (b,) uniforms -> tokens (b,) and their log-probs (b,), as sample_token returns."""
    if probing():
        return SHIPPED(logits, u, top_k=top_k, top_p=top_p)
    if top_k > 0 or top_p < 1.0:
        raise SystemExit("this ablation draws from the whole distribution: leave rollout.top_k/top_p off")
    log_z = torch.logsumexp(logits, -1)  # (b,)
    probs = (logits - log_z[:, None]).exp()
    draws = [
        torch.multinomial(probs[i], 1, generator=torch.Generator().manual_seed(int(u[i].item() * 2**53)))
        for i in range(logits.shape[0])
    ]
    token = torch.cat(draws)
    return token, logits.gather(-1, token[:, None]).squeeze(-1) - log_z


rollout_worker.sample_token = multinomial_token

if __name__ == "__main__":
    runpy.run_module("miniverl.main", run_name="__main__", alter_sys=True)
