"""A user's own model of another family than Llama and Qwen runs the recipe the first time: Phi-3
(fused qkv_proj and gate_up_proj), GPT-NeoX (no *_proj names at all), Gemma-3 (scaled embeddings,
sliding-window layers), Gemma-2 (no SDPA attention in transformers: eager), OPT (dropout in its
config, applied without a module) and Falcon (linear layers of its own class). Each is a small
random model of its family with the toy tokenizer, written as a Hugging Face folder; the run
adapts every linear layer with `model.lora.target_modules=all-linear`, samples and scores one
distribution, and resumes byte for byte. A target list that names layers the family lacks, and
an attention the family lacks, are refused in one line that says what to set."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from miniverl.config import to_config
from miniverl.config.model import StudentConfig
from miniverl.models import loading as models
from miniverl.models import precision
from miniverl.trainer.preflight import check_attention, check_positions
from miniverl.trainer.runner import run
from miniverl.utils.errors import MiniverlError

from conftest import ROOT, compose_config, family_folder, main, resumed_in_this_process

# Every linear layer but the output layer, by the family's own names: what all-linear must adapt.
FAMILIES = {
    "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    "gpt_neox": {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"},
    "gemma3_text": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "gemma2": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    # A model-families audit: OPT drops out as a function (F.dropout at config.dropout 0.1, no module), so the
    # actor missed it and the resume was not exact; Falcon's layers are a Linear subclass that returns a tensor,
    # refused as MoE routers (with a fix, [], that was refused in turn).
    "opt": {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"},
    "falcon": {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"},
}
RUN = [
    "+recipe=opd_k1",
    "hardware=cpu",
    "model.lora.target_modules=all-linear",
    "recipe.optimizer_updates=2",
    "recipe.interrupt_after_updates=null",
    "recipe.response_limit=8",
    "trainer.progress_bar=false",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: (family_folder(family, root, 0), family_folder(family, root, 1)) for family in FAMILIES}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_recipe_runs_adapts_every_linear_layer_and_resumes_exactly_on_another_family(family, folders, tmp_path):
    student, teacher = folders[family]
    attention = ["model.attn_implementation=eager", "teacher.attn_implementation=eager"] if family == "gemma2" else []
    overrides = [*RUN, *attention, f"model.model_id={student}", f"teacher.model_id={teacher}"]
    report, difference = resumed_in_this_process(overrides, tmp_path, after=1)  # stopped after 1, resumed
    assert report["status"] == "measured" and difference is None, difference
    run_dir = tmp_path / "whole"
    adapted = {
        name.split(".lora_")[0].rsplit(".", 1)[-1]
        for name in load_file(run_dir / "peft_adapter" / "adapter_model.safetensors")
    }
    assert adapted == FAMILIES[family]
    worst_allowed, mean_allowed = precision.log_prob_tolerance(torch.bfloat16)
    for update in (1, 2):  # the rollout samples the distribution the actor scores
        t = load_file(run_dir / "trajectories" / f"update_{update:06d}.safetensors")
        mask = t["response_mask"]
        diff = (t["rollout_log_probs"] - t["old_log_probs"]).abs() * mask
        assert float(diff.max()) <= worst_allowed and float(diff.sum() / mask.sum()) <= mean_allowed


def test_a_target_list_naming_layers_the_family_lacks_is_refused_with_its_layer_names(folders):
    """peft alone would adapt o_proj and say nothing of q_proj (Phi-3 fuses it into qkv_proj)."""
    block = StudentConfig(model_id=str(folders["phi3"][0]), quantization="none")
    block.lora.target_modules = ["q_proj", "o_proj"]
    source = models.source_of(block, None)
    with pytest.raises(MiniverlError) as refused:
        models.load_student(block, source, torch.device("cpu"), lora_seed=0)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("model.lora.target_modules: no layer of Phi3ForCausalLM")
    assert "named q_proj (its linear layers: o_proj, qkv_proj, gate_up_proj, down_proj); list those" in message
    assert message.endswith("or set model.lora.target_modules=all-linear")


def test_gpt2s_conv1d_layers_are_the_linear_layers_a_refusal_lists(tmp_path):
    """GPT-2 builds its projections from transformers' Conv1D, which peft's all-linear adapts too."""
    block = StudentConfig(model_id=str(family_folder("gpt2", tmp_path, 0)), quantization="none")
    block.lora.target_modules = ["q_proj"]
    with pytest.raises(MiniverlError, match=r"is named q_proj \(its linear layers: c_attn, c_proj, c_fc\)"):
        models.load_student(block, models.source_of(block, None), torch.device("cpu"), lora_seed=0)


def test_an_attention_the_family_lacks_is_refused_with_the_setting_to_change(folders):
    block = StudentConfig(model_id=str(folders["gemma2"][1]), quantization="none")
    source = models.source_of(block, None)
    phi3 = StudentConfig(model_id=str(folders["phi3"][0]))
    assert not models.model_class(block, source)._supports_sdpa
    assert models.model_class(phi3, models.source_of(phi3, None)).__name__ == "Phi3ForCausalLM"
    with pytest.raises(MiniverlError) as refused:
        models.load_causal_lm("teacher", block, source, torch.device("cpu"))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("teacher.attn_implementation='sdpa': Gemma2ForCausalLM")
    assert message.endswith("; set teacher.attn_implementation=eager")


def test_the_run_names_every_model_whose_family_lacks_sdpa_in_one_line_before_loading(folders, tmp_path):
    """The student and the teacher of one family: both settings at once, not one per attempt."""
    student, teacher = folders["gemma2"]
    done = main(*RUN, f"model.model_id={student}", f"teacher.model_id={teacher}", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "miniverl: error: pre-flight check failed (python -m miniverl.doctor shows all): attention: transformers has "
        "no SDPA attention for Gemma2ForCausalLM; set model.attn_implementation=eager teacher.attn_implementation=eager"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    "name,problem",
    [
        ("flash_attention_2", "flash_attention_2 needs a CUDA GPU and the flash_attn package"),
        ("sdpa2", "'sdpa2' is not one of sdpa, eager, flex_attention, flash_attention_2, flash_attention_3"),
    ],
)
def test_an_attention_that_cannot_run_here_is_refused_in_one_line_before_the_folder_is_a_runs(
    folders, tmp_path, name, problem
):
    """transformers would refuse flash attention on the CPU with a traceback, once the run folder
    held a plan.json that made the corrected command refuse the folder."""
    student, teacher = folders["phi3"]
    args = [*RUN, f"model.model_id={student}", f"teacher.model_id={teacher}", f"model.attn_implementation={name}"]
    with pytest.raises(MiniverlError) as refused:
        run(compose_config(args), tmp_path / "run")
    assert str(refused.value) == (
        "pre-flight check failed (python -m miniverl.doctor shows all): attention: "
        f"model.attn_implementation={name}: {problem}; set sdpa (where the family has it) or eager"
    )
    assert not (tmp_path / "run" / "plan.json").exists()


def test_the_attention_check_names_each_models_class_and_warns_of_what_it_could_not_read(folders, tmp_path):
    """A model whose config.json could not be read was a PASS "(not checked)" beside the FAILs it causes."""
    models_ = [f"model.model_id={folders['phi3'][0]}", f"teacher.model_id={tmp_path / 'nowhere'}"]
    check = check_attention(to_config(compose_config(["+recipe=opd_k1", *models_])), torch.device("cpu"))
    assert (check.status, check.reason) == (
        "WARN",
        "model sdpa (Phi3ForCausalLM); teacher sdpa (not checked: no config.json read)",
    )
    read = check_attention(
        to_config(
            compose_config(
                ["+recipe=opd_k1", f"model.model_id={folders['phi3'][0]}", f"teacher.model_id={folders['phi3'][1]}"]
            )
        ),
        torch.device("cpu"),
    )
    assert (read.status, read.reason) == ("PASS", "model sdpa (Phi3ForCausalLM); teacher sdpa (Phi3ForCausalLM)")


def test_a_prompt_and_response_beyond_the_models_positions_are_refused_in_one_line_before_the_folder_is_a_runs(
    folders, tmp_path
):
    """A new-user audit ran a Llama of 512 positions on 639-token sequences (recipe.prompt_limit=4000) with no
    word from the run or the doctor: transformers runs past max_position_embeddings silently."""
    student, teacher = folders["phi3"]  # max_position_embeddings=512 (conftest.family_folder)
    models_ = [f"model.model_id={student}", f"teacher.model_id={teacher}"]
    fits = check_positions(to_config(compose_config([*RUN, *models_, "recipe.prompt_limit=504"])))
    assert (fits.status, fits.reason) == ("PASS", "model 512 of 512 positions; teacher 512 of 512 positions")
    args = [*RUN, *models_, "recipe.prompt_limit=4000"]
    with pytest.raises(MiniverlError) as refused:
        run(compose_config(args), tmp_path / "run")
    assert str(refused.value) == (
        "pre-flight check failed (python -m miniverl.doctor shows all): positions: "
        + "; ".join(
            f"{where}: recipe.prompt_limit + recipe.response_limit = 4008 tokens is beyond its max_position_embeddings "
            f"(512, the positions it was trained for; verl's vLLM rollout refuses such a max_model_len too): lower "
            "recipe.prompt_limit or recipe.response_limit"
            for where in ("model", "teacher")
        )
    )
    assert not (tmp_path / "run" / "plan.json").exists()
    # A teacher's own context limit is the one named for it; a teacher on the student's model is not read twice.
    own = check_positions(
        to_config(
            compose_config([*RUN, *models_, "teacher.context.system=Answer.", "teacher.context.prompt_limit=600"])
        )
    )
    assert own.status == "FAIL" and own.reason.startswith("teacher: teacher.context.prompt_limit + recipe.response")
    shared = check_positions(to_config(compose_config([*RUN, f"model.model_id={student}", "teacher.mode=ref"])))
    assert shared.reason == "model 136 of 512 positions"
    # The held-out probe's longer responses count where the probe runs (a config audit: never checked).
    probe = [
        *models_,
        "eval.every=1",
        "eval.response_limit=500",
        "recipe.prompt_limit=100",
        f"data.val_files={ROOT / 'data' / 'toy_prompts_heldout.parquet'}",
    ]
    longer = check_positions(to_config(compose_config([*RUN, *probe])))
    assert longer.status == "FAIL" and longer.reason.startswith(
        "model: recipe.prompt_limit + eval.response_limit = 600 tokens is beyond its max_position_embeddings (512"
    )
    off = check_positions(to_config(compose_config([*RUN, *probe, "eval.every=-1"])))
    assert off.status == "PASS"
    # BLOOM's config names no limit (ALiBi): a model-families audit read "176 of unnamed positions".
    from transformers import AutoConfig

    AutoConfig.for_model("bloom", n_embed=64, n_layer=2, n_head=4).save_pretrained(tmp_path / "bloom")
    alibi = check_positions(
        to_config(compose_config([*RUN, f"model.model_id={tmp_path / 'bloom'}", "teacher.mode=ref"]))
    )
    assert alibi.reason == "model 136 positions (its config names no limit)"
