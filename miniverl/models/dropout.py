"""Whether a model's train-mode forward is a random draw (dropout), which decides how the actor takes
its old log-probs and seeds an update (workers/actor.py)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

# Probabilities of heads a causal LM does not have (sequence classification, GPT-2's double heads): GPT-NeoX's
# config holds classifier_dropout 0.1 by default, and its causal LM drops nothing.
OTHER_HEADS_DROPOUT = ("classifier_dropout", "summary_first_dropout")


def draws_dropout(model: torch.nn.Module) -> bool:
    """True where a train-mode forward drops anything: an nn.Dropout with p > 0 (GPT-2's, peft's
    lora_dropout), or a probability of the model's config above 0 under a name with "drop" in it,
    which a family may apply as a function without a module (OPT's F.dropout at config.dropout, its
    layerdrop; attention_dropout inside attention), its sub-configs' (a text_config) too."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    return _config_drops(getattr(model, "config", None))


def _config_drops(config) -> bool:
    if not isinstance(config, PretrainedConfig):
        return False
    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig) and _config_drops(value):
            return True
        if name in OTHER_HEADS_DROPOUT:
            continue
        if "drop" in name and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return True
    return False
