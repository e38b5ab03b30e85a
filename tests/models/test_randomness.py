"""Whether a train-mode forward is a random draw: the actor's old log-probs and its per-update seed
depend on it (workers/actor.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from miniverl.models.randomness import train_forward_is_random

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
OWN_SIZES = {
    "opt": {"ffn_dim": 64, "word_embed_proj_dim": 32},
    "phimoe": {"num_key_value_heads": 2, "num_local_experts": 2, "intermediate_size": 64},
    "mixtral": {"num_key_value_heads": 2, "num_local_experts": 2, "intermediate_size": 64},
}


def small(family: str, **config) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(
            AutoConfig.for_model(family, **SMALL, **OWN_SIZES.get(family, {}), **config)
        )


def train_forwards_differ(model: torch.nn.Module) -> bool:
    model.train()
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        first, second = (model(input_ids=ids).logits for _ in range(2))
    return not torch.equal(first, second)


@pytest.mark.parametrize(
    ("family", "config", "random"),
    [
        ("opt", {}, True),  # F.dropout at config.dropout 0.1, no nn.Dropout module: the case missed before
        ("opt", {"dropout": 0.0}, False),
        ("gpt2", {}, True),  # nn.Dropout modules
        ("llama", {"attention_dropout": 0.1}, True),  # inside attention
        ("llama", {}, False),
        ("gpt_neox", {}, False),  # its classifier_dropout 0.1 is a classification head's: not the causal LM's
        ("mixtral", {"router_jitter_noise": 0.1}, True),  # the router scales its input by uniform noise
        ("mixtral", {}, False),
        # samples its experts in training (Gumbel) among those within router_jitter_noise of the best
        ("phimoe", {"router_jitter_noise": 0.5}, True),
        ("phimoe", {"router_jitter_noise": 0.0}, False),  # only the best is left to sample
    ],
)
def test_a_train_forward_is_random_exactly_where_two_of_them_differ(family, config, random):
    model = small(family, **config)
    assert train_forward_is_random(model) is random
    assert train_forwards_differ(model) is random  # the behaviour the answer stands for


def test_loras_dropout_and_a_text_configs_dropout_count():
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(small("llama"), LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=0.1))
    assert train_forward_is_random(wrapped.get_base_model())
    outer = small("llama")
    outer.config.text_config = AutoConfig.for_model("opt")  # a composite config's language model drops out
    assert train_forward_is_random(outer)
