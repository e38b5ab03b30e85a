"""Ablation (docs/learning.md): the k1 policy gradient with the student's own term of the reverse KL
computed exactly instead of from the sampled token; everything else as shipped, the held-out probe
unchanged.

    python scripts/ablate_exact_entropy.py [--sampled-weight C] +recipe=opd_k1_real_cpu \\
        recipe.optimizer_updates=16 eval.every=8 recipe.interrupt_after_updates=null trainer.seed=S

The gradient of the reverse KL at a position, E_q[log q(y) - log p(y)] (q the student, p the
teacher), is E_q[grad log q(y) (log q(y) - log p(y))]. Its first part is minus the gradient of the
student's entropy H, which the student's own logits give exactly, without the teacher. With
--sampled-weight C the loss is the policy gradient with advantage -(C log q(y) - log p(y) - b),
b the update's mean of the same, minus (1 - C) H: the same expected gradient for every C. C = 1 is
the shipped k1 (up to rounding: the log-probs here come from a plain float32 log-softmax); C = 0
(the default) takes the whole entropy term exactly, and leaves only the teacher's log-prob to the
sample. Every sampled log q(y) is then missing from the advantage, where it had cancelled part of
log p(y)'s spread (the two move together).
"""

from __future__ import annotations

import runpy
import sys

import torch

import miniverl.workers.actor as actor_module
from miniverl.workers.logprobs import (
    map_position_chunks,
    output_rows,
    response_hidden_states,
    rows_per_chunk,
    token_logits,
)
from miniverl.workers.losses import agg_loss, masked_range

SAMPLED_WEIGHT = 0.0
CENTRED = "--entropy-baseline" in sys.argv  # the advantage -(log q(y) + H - log p(y) - b): H a per-position baseline
if CENTRED:
    sys.argv.remove("--entropy-baseline")
    SAMPLED_WEIGHT = 1.0
if "--sampled-weight" in sys.argv:
    at = sys.argv.index("--sampled-weight")
    SAMPLED_WEIGHT = float(sys.argv[at + 1])
    del sys.argv[at : at + 2]


def sampled_part_mean(est, old_log_prob, teacher_log_prob, response_mask, spans=None) -> float:
    """b: the update's token mean of C log q(y) - log p(y) under the policy that sampled it."""
    if spans is not None or est.loss_mode != "k1" or est.loss_max_clamp is not None:
        raise SystemExit("this ablation is of the k1 estimator without a clamp and with one tokenizer")
    mask = response_mask.bool()
    part = SAMPLED_WEIGHT * old_log_prob - teacher_log_prob.to(old_log_prob.dtype)
    return float(part[mask].mean()) if mask.any() else 0.0


def chunk_loss(self, chunk, normalisers, selection=None, baseline=0.0):
    """The actor's loss for these rows: (loss, per-token k1 (b, R), metrics, log q(y) (b, R))."""
    if selection is not None:
        raise SystemExit("this ablation trains on every response token: leave estimator.token_selection off")
    lm_head = self.model.get_output_embeddings()
    vocab, temperature = self.tokenizer_vocab, self.temperature

    def per_position(h, tokens):  # (n, H), (n,) -> log q(y) (n,), H (n,), with their gradients
        log_q = torch.log_softmax(token_logits(lm_head, h, vocab, temperature), -1)  # (n, V)
        return log_q.gather(-1, tokens[:, None]).squeeze(-1), -(log_q.exp() * log_q).sum(-1)

    hidden = response_hidden_states(self.model, chunk)  # (b, R, H)
    rows = rows_per_chunk(self.logprob_chunk, output_rows(lm_head, vocab))
    log_prob, entropy = map_position_chunks(per_position, hidden, chunk.responses, chunk=rows)  # (b, R) each
    teacher = chunk.teacher_logprobs.to(log_prob.dtype)
    mask = chunk.scored_mask.bool()
    if CENTRED:  # one chunk holds the recipe's whole update (4 rows): its mean is the update's
        centred = log_prob.detach() + entropy.detach() - teacher  # E_q[log q(y) + H] = 0 at every position
        advantage = -(centred - centred[mask].mean())
        per_token = -advantage * torch.exp(log_prob - log_prob.detach())
    else:
        advantage = -(SAMPLED_WEIGHT * log_prob.detach() - teacher - baseline)
        per_token = -advantage * torch.exp(log_prob - log_prob.detach()) - (1.0 - SAMPLED_WEIGHT) * entropy
    loss = agg_loss(
        per_token,
        mask,
        "token-mean",
        batch_num_tokens=normalisers["batch_num_tokens"],
        global_batch_size=normalisers["global_batch_size"],
    )
    k1 = (log_prob - teacher).detach()
    metrics = masked_range(k1, mask, "distillation/loss")
    metrics["distillation/abs_loss"] = float(k1.abs()[mask].mean()) if mask.any() else 0.0
    return loss, k1, metrics, log_prob


actor_module.distillation_baseline = sampled_part_mean
actor_module.ActorWorker._chunk_loss = chunk_loss

if __name__ == "__main__":
    runpy.run_module("miniverl.main", run_name="__main__", alter_sys=True)
