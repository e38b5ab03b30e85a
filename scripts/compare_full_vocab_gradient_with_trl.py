"""Diagnosis (docs/learning.md): along a miniverl `estimator=reverse_kl_full` run, its actor's LoRA
gradient against the gradient of TRL's own full-vocabulary loss (`DistillationTrainer`'s
`_chunked_divergence_loss`, beta 1) on the same batch: the same student hidden states, the same
teacher hidden states and output layers. Prints one line per update; the run itself is unchanged.

    python scripts/compare_full_vocab_gradient_with_trl.py +recipe=opd_k1_real_cpu \\
        estimator=reverse_kl_full estimator.advantage_baseline=none recipe.interrupt_after_updates=null \\
        data.train_files=data/toy_mixed.parquet data.val_files=data/toy_mixed_heldout.parquet trainer.seed=1

Needs TRL (the test extra installs it).
"""

from __future__ import annotations

import runpy
import sys

import torch
from trl.trainer.distillation_trainer import _chunked_divergence_loss

from miniverl.models import cpu_gemm
from miniverl.workers import actor as actor_module
from miniverl.workers.logprobs import response_hidden_states

SHIPPED = actor_module.ActorWorker._accumulate
updates = 0


def flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads]).double()  # float64: a cosine of ~10^6 terms


def compared(self, batch, chunks):
    """The shipped accumulation (its gradients kept for the step), then TRL's loss on the same batch."""
    global updates
    result = SHIPPED(self, batch, chunks)
    ours = [p.grad.detach().clone() for p in self.params]
    for p in self.params:
        p.grad = None
    self.peft_model.train()
    with cpu_gemm.float32_products(self.model, self.float32_gemm):
        hidden = response_hidden_states(self.model, batch)  # (B, R, H)
    loss, entropy_sum, positions = _chunked_divergence_loss(
        hidden,
        batch.teacher_hidden_states,  # (B, R, H)
        self.model.get_output_embeddings().weight,
        self.teacher_heads[0].weight,
        batch.response_mask,
        1.0,  # beta 1: the reverse KL
        temperature=self.temperature,
    )
    loss.backward()
    theirs = flat([p.grad.detach() for p in self.params])
    mine = flat(ours)
    updates += 1
    print(
        f"update {updates}: cosine {float(mine @ theirs / (mine.norm() * theirs.norm())):.5f}, "
        f"gradient norm miniverl {float(mine.norm()):.5f} TRL {float(theirs.norm()):.5f}, "
        f"TRL loss {float(loss):.5f}, student entropy {float(entropy_sum / positions):.4f} nats",
        file=sys.stderr,
        flush=True,
    )
    for p, g in zip(self.params, ours):  # the shipped step goes on with miniverl's own gradient
        p.grad = g
    self.peft_model.eval()
    return result


actor_module.ActorWorker._accumulate = compared
sys.argv = ["miniverl.main", *sys.argv[1:]]
runpy.run_module("miniverl.main", run_name="__main__")
