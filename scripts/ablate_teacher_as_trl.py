"""Ablation (docs/learning.md): the training teacher's log-probs computed as TRL's IW-OPD computes
them; everything else as shipped, the held-out probe unchanged.

    python scripts/ablate_teacher_as_trl.py [--bf16-log-softmax] [--repacked-kernel] \\
        +recipe=opd_k1_real_cpu recipe.optimizer_updates=16 eval.every=8 \\
        recipe.interrupt_after_updates=null trainer.seed=S

--bf16-log-softmax: the log-softmax over the teacher's bf16 logits in bf16 (TRL: `F.log_softmax`
of the teacher's logits, as the model returns them), instead of miniverl's float32.
--repacked-kernel: the teacher's 4-bit layers run bitsandbytes' own AVX512-BF16 kernel (its absmax
rounded to bf16), as a plain transformers model does on such a CPU, on a copy of the teacher;
miniverl's loader switches that repack off so that every role computes one product.

Only the teacher's scores of the training rollouts change: the probe measures every run with the
shipped teacher, on the same sample paths.
"""

from __future__ import annotations

import runpy
import sys

import torch

import miniverl.workers.teacher as teacher_module
from miniverl.bench.setups import as_shipped
from miniverl.workers.logprobs import response_hidden_states

BF16_LOG_SOFTMAX = "--bf16-log-softmax" in sys.argv
REPACKED_KERNEL = "--repacked-kernel" in sys.argv
sys.argv = [a for a in sys.argv if a not in ("--bf16-log-softmax", "--repacked-kernel")]
SHIPPED = teacher_module.response_log_probs
twins: dict[int, torch.nn.Module] = {}


def scoring_model(model: torch.nn.Module) -> torch.nn.Module:
    if not REPACKED_KERNEL:
        return model
    if id(model) not in twins:
        twin = as_shipped(model, next(model.parameters()).device)
        if twin is None:
            raise SystemExit("--repacked-kernel: this CPU has no AVX512-BF16 (or oneDNN is capped below it)")
        twins[id(model)] = twin.eval()
    return twins[id(model)]


def teacher_log_probs(model, batch, *, temperature=1.0, chunk=256, tokenizer_vocab=None):
    """(B, R) float32 log-probs of the sampled tokens, as TRL computes them."""
    if temperature != 1.0 or not (BF16_LOG_SOFTMAX or REPACKED_KERNEL):
        return SHIPPED(model, batch, temperature=temperature, chunk=chunk, tokenizer_vocab=tokenizer_vocab)
    model = scoring_model(model)
    hidden = response_hidden_states(model, batch)  # (B, R, H)
    logits = model.get_output_embeddings()(hidden)[..., :tokenizer_vocab]  # (B, R, V) in the head's dtype
    if not BF16_LOG_SOFTMAX:
        logits = logits.float()
    picked = torch.log_softmax(logits, -1).gather(-1, batch.responses[..., None]).squeeze(-1)
    return picked.float()


teacher_module.response_log_probs = teacher_log_probs

if __name__ == "__main__":
    print(f"ablation: bf16 log-softmax {BF16_LOG_SOFTMAX}, repacked kernel {REPACKED_KERNEL}", flush=True)
    runpy.run_module("miniverl.main", run_name="__main__", alter_sys=True)
