"""Whether a model's train-mode forward is a random draw (dropout, a router's jitter, experts sampled
in training), which decides how the actor takes its old log-probs and whether it seeds an update
(workers/actor.py)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

# Probabilities of heads a causal LM does not have (sequence classification, summary heads): GPT-NeoX's
# config holds classifier_dropout 0.1 by default, and its causal LM drops nothing.
OTHER_HEADS = ("classifier_", "summary_")
RANDOM_NAMES = ("drop", "jitter")  # OPT's dropout and layerdrop, GPT-2's *_pdrop, Mixtral's router_jitter_noise


def train_forward_is_random(model: torch.nn.Module) -> bool:
    """True where a train-mode forward draws at random: an nn.Dropout with p > 0 (GPT-2's, peft's
    lora_dropout), or a probability above 0 in the config (its sub-configs' too) under a name with
    "drop" or "jitter" in it, which a family may apply as a function without a module (OPT's F.dropout
    at config.dropout, its layerdrop; Mixtral's router jitter; Phi-3.5-MoE samples its experts among
    those within its router_jitter_noise of the best)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    return _config_draws(getattr(model, "config", None))


def _config_draws(config) -> bool:
    if not isinstance(config, PretrainedConfig):
        return False
    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig) and _config_draws(value):
            return True
        if name.startswith(OTHER_HEADS) or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if any(part in name for part in RANDOM_NAMES) and value > 0:
            return True
    return False
