"""Rollout role (verl: `generate_sequences`): the student samples responses.

The student runs in eval mode without autograd, with a KV cache (gradient checkpointing is only
active in train mode). Each sample has its own sampling stream (a torch.Generator seeded from
the plan) and draws exactly one number per step, so the tokens a sample gets do not depend on
which other samples share its physical batch. Only the sampled token's log-prob is kept per step.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from miniverl.batch import Batch
from miniverl.schema.actor import RolloutConfig


def cache_keyword(decoder: torch.nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache`; use whichever this version takes."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids, mask), both (B, P), left-padded to the longest prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """verl/vLLM-style top-k then top-p filtering of (B, V) logits (-inf outside the kept set)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > top_p  # keep the first token that crosses top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


class RolloutWorker:
    def __init__(self, model: PreTrainedModel, config: RolloutConfig, *, eos_id: int, pad_id: int,
                 device: torch.device):
        self.model = model  # the student (LoRA active); shared with the actor
        self.config = config
        self.eos_id, self.pad_id, self.device = eos_id, pad_id, device
        self.cache_kw = cache_keyword(model.get_decoder())

    @torch.no_grad()
    def generate_sequences(self, prompts: list[list[int]], prompt_rows: list[int], seeds: list[int], *,
                           response_limit: int, physical_batches: list[int]) -> Batch:
        """Sample one response per prompt; `physical_batches` are the row counts of each forward."""
        self.model.eval()
        ids, mask = left_pad(prompts, self.pad_id, self.device)  # (B, P)
        parts, start = [], 0
        for size in physical_batches:
            rows = slice(start, start + size)
            parts.append(self._decode(ids[rows], mask[rows], seeds[rows], response_limit))
            start += size
        width = max(1, max(int(m.sum(-1).max()) for _, m, _ in parts))  # longest response of the batch
        responses = torch.cat([pad_right(r, width, self.pad_id) for r, _, _ in parts])  # (B, R)
        response_mask = torch.cat([pad_right(m, width, 0) for _, m, _ in parts]).float()
        log_probs = torch.cat([pad_right(lp, width, 0.0) for _, _, lp in parts])
        return assemble(ids, mask, responses, response_mask, log_probs,
                        torch.tensor(prompt_rows, dtype=torch.long, device=self.device))

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor, seeds: list[int], limit: int):
        """One physical batch: returns responses (b, R'), response mask (b, R'), log-probs (b, R')."""
        temperature, top_k, top_p = self.config.temperature, self.config.top_k, self.config.top_p
        streams = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
        decoder, lm_head = self.model.get_decoder(), self.model.get_output_embeddings()
        cache = DynamicCache(config=self.model.config)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (b, P)
        hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self.cache_kw: cache}).last_hidden_state[:, -1]  # (b, H)
        next_position = positions[:, -1:] + 1  # (b, 1)
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=self.device)
        tokens, alive, log_probs = [], [], []
        for step in range(limit):
            logits = lm_head(hidden).float() / temperature  # (b, V)
            probs = filter_logits(logits, top_k, top_p).softmax(-1)
            token = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(streams)])  # (b,)
            log_probs.append(logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1))
            tokens.append(token.masked_fill(done, self.pad_id))
            alive.append(~done)
            done = done | token.eq(self.eos_id)
            if bool(done.all()) or step == limit - 1:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            hidden = decoder(input_ids=tokens[-1][:, None], attention_mask=mask, position_ids=next_position,
                             use_cache=True, **{self.cache_kw: cache}).last_hidden_state[:, -1]
            next_position = next_position + 1
        alive_mask = torch.stack(alive, 1).long()
        return torch.stack(tokens, 1), alive_mask, torch.stack(log_probs, 1) * alive_mask


def pad_right(x: torch.Tensor, width: int, value) -> torch.Tensor:
    if x.shape[1] >= width:
        return x[:, :width]
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def assemble(prompts, prompt_mask, responses, response_mask, rollout_log_probs, prompt_rows) -> Batch:
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)  # (B, L)
    return Batch(
        prompt_rows=prompt_rows,
        prompts=prompts,
        responses=responses,
        input_ids=torch.cat([prompts, responses], dim=1),
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        response_mask=response_mask,
        rollout_log_probs=rollout_log_probs,
    )
