"""Ablation (docs/learning.md): the training rollout drawn by Hugging Face's `generate` (TRL's
rollout without vLLM: the model's own forward with its KV cache, bitsandbytes' own 4-bit path, and
`torch.multinomial` over the softmax) instead of miniverl's decode loop; everything else as shipped,
the held-out probe unchanged.

    python scripts/ablate_hf_generate.py +recipe=opd_k1_real_cpu recipe.optimizer_updates=16 \\
        eval.every=8 recipe.interrupt_after_updates=null trainer.seed=S

Each physical batch seeds torch's global generator from its first sample's seed, so the run stays
deterministic; the rollout's log-probs are those of `generate`'s own logits. The probe keeps the
shipped decode, so every run's held-out KL is measured on the same sample paths.
"""

from __future__ import annotations

import runpy

import torch
from shipped_probe import probing  # the probe keeps the shipped decode

import miniverl.workers.rollout.worker as rollout_worker

SHIPPED = rollout_worker.RolloutWorker._decode


def generate_decode(self, ids: torch.Tensor, mask: torch.Tensor, seeds: list[int], limit: int):
    """One physical batch through `model.generate`: responses (b, R'), mask (b, R'), log-probs (b, R')."""
    if probing():
        return SHIPPED(self, ids, mask, seeds, limit)
    if self.config.top_k > 0 or self.config.top_p < 1.0 or self.config.temperature != 1.0:
        raise SystemExit("this ablation samples the plain distribution: leave rollout.top_k/top_p/temperature off")
    torch.manual_seed(int(seeds[0]))
    out = self.model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        max_new_tokens=limit,
        eos_token_id=self.eos_ids.tolist(),
        pad_token_id=self.pad_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    tokens = out.sequences[:, ids.shape[1] :]  # (b, R')
    logits = torch.stack(out.logits, 1)[..., : self.tokenizer_vocab].float()  # (b, R', V)
    log_probs = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    ended = torch.isin(tokens, self.eos_ids).long()
    alive = (ended.cumsum(-1) - ended) == 0  # up to and including the first EOS
    tokens = tokens.masked_fill(~alive, self.pad_id)
    return tokens.clone(), alive.long(), (log_probs * alive).clone()


rollout_worker.RolloutWorker._decode = generate_decode

if __name__ == "__main__":
    runpy.run_module("miniverl.main", run_name="__main__", alter_sys=True)
