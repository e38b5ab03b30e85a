"""Diagnosis (docs/learning.md): along a miniverl run, its actor's LoRA gradient against the gradient
of TRL's own loss for the same objective on the same batch (the same student hidden states, the same
teacher values). Prints one line per update; the run itself is unchanged.

- `estimator=reverse_kl_full`: `DistillationTrainer`'s `_chunked_divergence_loss` (beta 1) on the
  teacher's hidden states and output layer;
- `estimator=k1` (policy gradient, `estimator.loss_max_clamp=null estimator.advantage_baseline=none`:
  what TRL computes): `IWOPDTrainer._compute_iw_opd_loss` (gamma 0) on the teacher's log-probs of the
  sampled tokens.

    python scripts/compare_gradient_with_trl.py +recipe=opd_k1_real_cpu \\
        estimator=reverse_kl_full estimator.advantage_baseline=none recipe.interrupt_after_updates=null \\
        data.train_files=data/toy_mixed.parquet data.val_files=data/toy_mixed_heldout.parquet trainer.seed=1

Needs TRL (the test extra installs it).
"""

from __future__ import annotations

import runpy
import sys
from collections import defaultdict
from types import SimpleNamespace

import torch
from trl.experimental.iw_opd import IWOPDTrainer
from trl.trainer.distillation_trainer import _chunked_divergence_loss

from miniverl.models import cpu_gemm
from miniverl.workers import actor as actor_module
from miniverl.workers.logprobs import response_hidden_states

SHIPPED = actor_module.ActorWorker._accumulate
updates = 0


def flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads]).double()  # float64: a cosine of ~10^6 terms


def trl_full_vocab_loss(self, batch, hidden: torch.Tensor) -> tuple[torch.Tensor, str]:
    loss, entropy_sum, positions = _chunked_divergence_loss(
        hidden,
        batch.teacher_hidden_states,  # (B, R, H)
        self.model.get_output_embeddings().weight,
        self.teacher_heads[0].weight,
        batch.response_mask,
        1.0,  # beta 1: the reverse KL
        temperature=self.temperature,
    )
    return loss, f"student entropy {float(entropy_sum / positions):.4f} nats"


def trl_iw_opd_loss(self, batch, hidden: torch.Tensor) -> tuple[torch.Tensor, str]:
    estimator = self.estimator
    if estimator.loss_max_clamp is not None or estimator.advantage_baseline != "none":
        raise SystemExit("TRL's IW-OPD has no clamp and no baseline: add estimator.loss_max_clamp=null "
                         "estimator.advantage_baseline=none")  # fmt: skip
    logits = self.model.get_output_embeddings()(hidden).float()[..., : self.tokenizer_vocab]  # (B, R, V)
    valid = batch.response_mask.bool()
    trainer = SimpleNamespace(  # the attributes _compute_iw_opd_loss reads, as IWOPDConfig sets them
        temperature=self.temperature,
        iw_opd_gamma=0.0,
        iw_opd_epsilon=1e-8,
        model=self.peft_model,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    loss = IWOPDTrainer._compute_iw_opd_loss(
        trainer,
        logits,
        batch.responses,
        torch.where(valid, batch.responses, -100),
        batch.teacher_logprobs,
    )
    return loss, f"mean advantage {trainer._metrics['train']['iw_opd/mean_advantage'][0]:.4f}"


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
        if self.estimator.loss_mode == "reverse_kl_full":
            loss, detail = trl_full_vocab_loss(self, batch, hidden)
        elif self.estimator.loss_mode == "k1" and self.estimator.use_policy_gradient:
            loss, detail = trl_iw_opd_loss(self, batch, hidden)
        else:
            raise SystemExit("compares estimator=reverse_kl_full or estimator=k1 (policy gradient) only")
        loss.backward()
    theirs = flat([p.grad.detach() for p in self.params])
    mine = flat(ours)
    updates += 1
    print(
        f"update {updates}: cosine {float(mine @ theirs / (mine.norm() * theirs.norm())):.5f}, "
        f"gradient norm miniverl {float(mine.norm()):.5f} TRL {float(theirs.norm()):.5f}, "
        f"TRL loss {float(loss):.5f}, {detail}",
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
