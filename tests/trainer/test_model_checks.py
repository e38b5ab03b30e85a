"""The doctor on families whose configs and layers are not Llama's: GPT-2 (Conv1D layers, no
intermediate_size), OPT (dropout on by default, ffn_dim), a vision-language checkpoint (Gemma-3 4B and
up: its sizes in text_config), Jamba (a Mamba mixer that computes otherwise when quantized) and a
mixture of experts (its experts are 3-D parameters). An audit ran
them: the memory estimate's AttributeError was a traceback before any model loaded, the nf4-gradients
check failed on GPT-2's transposed weights and on OPT's dropout masks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, OPTConfig

from miniverl.config.model import StudentConfig
from miniverl.models import toy
from miniverl.trainer.memory_estimate import architecture, weight_bytes

from conftest import run_as_command


def config_folder(tmp_path, config) -> str:
    config.save_pretrained(tmp_path / type(config).__name__)
    return str(tmp_path / type(config).__name__)


def test_the_memory_estimate_reads_each_familys_sizes_by_its_own_names(tmp_path):
    from transformers import FalconConfig, Gemma3Config, Qwen3MoeConfig

    def sizes(config):
        return architecture("model", StudentConfig(model_id=config_folder(tmp_path, config)))

    gpt2 = sizes(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256))
    assert (gpt2["hidden"], gpt2["inter"], gpt2["layers"], gpt2["heads"], gpt2["positions"]) == (64, 256, 2, 4, 256)
    assert sizes(FalconConfig(hidden_size=64, ffn_hidden_size=96, num_attention_heads=4))["inter"] == 96
    assert sizes(OPTConfig(hidden_size=64, ffn_dim=80, num_attention_heads=4))["inter"] == 80
    text = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=32
    )  # head_dim and the key-value heads unlike the defaults: each read from text_config
    vision = sizes(Gemma3Config(text_config={**text, "num_key_value_heads": 1}))  # gemma-3-4b-it and up
    assert (vision["hidden"], vision["inter"], vision["head_dim"], vision["kv"]) == (64, 128, 32, 1)
    moe = sizes(
        Qwen3MoeConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_experts=8, moe_intermediate_size=32
        )
    )
    assert moe["expert_weights"] == 2 * 8 * 3 * 64 * 32 and moe["inter"] == 0  # every MLP is the experts'
    # Experts stay as they load under NF4 (3-D parameters, no linear layers): counted in their dtype.
    bf16 = {**moe, "dtype": "bfloat16"}
    assert (
        weight_bytes(bf16, "nf4", 2) - weight_bytes({**bf16, "expert_weights": 0}, "nf4", 2) == 2 * 8 * 3 * 64 * 32 * 2
    )


def family_without_llamas_names(tmp_path, config) -> str:
    tokenizer = toy.build_toy_tokenizer()
    for each in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        each.vocab_size, each.eos_token_id, each.pad_token_id = len(tokenizer), tokenizer.eos_token_id, 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    return str(toy.save_toy(model, tokenizer, tmp_path / type(config).__name__, "bfloat16"))


def vision_language_config():
    """gemma-3-4b-it's layout, tiny: a SigLIP vision tower beside the language model, which all-linear adapts too
    and text gives no gradient (the nf4-gradients check compared gradients that were None)."""
    from transformers import Gemma3Config

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    return Gemma3Config(
        text_config={**text, "max_position_embeddings": 512},
        vision_config={**vision, "patch_size": 14},
        mm_tokens_per_image=4,
        boi_token_index=3,
        eoi_token_index=4,
        image_token_index=5,
    )


def jamba_config():
    """A Mamba hybrid whose mixer calls dt_proj (and its LoRA) only where the config says quantized: the
    nf4-gradients check's dense twin multiplied by dt_proj.weight instead, and FAILed a sound model (an audit)."""
    from transformers import JambaConfig

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    layers = dict(expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1)
    mamba = dict(mamba_d_state=8, mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False)
    return JambaConfig(**sizes, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, **layers, **mamba)


@pytest.mark.parametrize(
    "config",
    [
        GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512),  # Conv1D layers, no intermediate_size
        OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, dropout=0.1),
        vision_language_config(),
        jamba_config(),
    ],
    ids=["gpt2", "opt", "gemma3-vision-language", "jamba"],
)
def test_the_doctor_passes_families_without_llamas_names_or_with_dropout(tmp_path, capfd, config):
    folder = family_without_llamas_names(tmp_path, config)
    overrides = [f"model.model_id={folder}", f"teacher.model_id={folder}", "model.lora.target_modules=all-linear"]
    status = run_as_command("doctor", "+recipe=opd_k1", "hardware=cpu", *overrides)
    out = capfd.readouterr().out
    assert status == 0, out
    assert "memory: estimated peak" in out and "doctor: 7/7 checks without FAIL" in out  # Jamba's experts: a WARN
    assert "PASS nf4-gradients: largest relative difference of the LoRA gradients: 0.0e+00" in out


def test_a_mixture_of_experts_student_is_warned_that_its_experts_stay_unquantized(tmp_path):
    from transformers import Qwen3MoeConfig

    from miniverl.config import to_config
    from miniverl.trainer import preflight

    from conftest import compose_config

    moe = Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_experts=8)
    cfg = to_config(compose_config(["+recipe=opd_k1", "teacher=toy", f"model.model_id={config_folder(tmp_path, moe)}"]))
    check = preflight.check_memory(cfg, torch.device("cpu"))
    assert check.status == "WARN" and check.reason.endswith(
        "the student's routed experts (2.36M weights, 3-D parameters, not linear layers) load unquantized: NF4 "
        "takes linear layers only (peft may adapt them: the adapter's target_parameters)"
    )


def test_a_check_that_fails_in_an_unforeseen_way_is_its_own_fail_line_not_the_doctors_traceback(monkeypatch):
    from miniverl.trainer.preflight import guarded

    def breaks():
        raise RuntimeError("The size of tensor a (192) must match the size of tensor b (64)\nmore")

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    assert str(guarded("nf4-gradients", breaks)) == (
        "FAIL nf4-gradients: the check itself failed (RuntimeError: The size of tensor a (192) must match the size "
        "of tensor b (64)); HYDRA_FULL_ERROR=1 shows where"
    )
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # only 1 asks for the traceback
    assert guarded("nf4-gradients", breaks).status == "FAIL"
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(RuntimeError):
        guarded("nf4-gradients", breaks)
