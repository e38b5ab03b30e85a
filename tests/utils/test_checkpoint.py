"""Saving the adapter of an offline run: no hub look-up, no warning, the same files."""

from __future__ import annotations

import warnings

from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from miniverl.config.model import ToyArchitecture
from miniverl.models import toy
from miniverl.utils import checkpoint


def _student(model_id: str):
    tokenizer = toy.build_toy_tokenizer()
    model = toy.build_toy_model(ToyArchitecture(), tokenizer, seed=0)
    model.config.name_or_path = model.name_or_path = model_id  # as a hub model loaded offline names itself
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def test_an_offline_hub_base_saves_its_adapter_without_asking_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    student = _student("Qwen/Qwen3-0.6B")  # not on disk: peft's "auto" would look it up and warn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.save_adapter(student, tmp_path / "adapter")
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert saved and all("lora_" in name for name in saved)  # the LoRA matrices only, no embedding


def test_lora_on_the_output_layer_saves_it_whole():
    student = _student("Qwen/Qwen3-0.6B")
    assert not checkpoint.embeddings_targeted(student)
    student.peft_config["default"].target_modules = {"q_proj", "lm_head"}
    assert checkpoint.embeddings_targeted(student)


def test_resume_from_a_missing_or_empty_folder_says_which_and_what_to_give(tmp_path, monkeypatch):
    import pytest

    from miniverl.utils.errors import MiniverlError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(MiniverlError) as refused:
        checkpoint.resolve_checkpoint("outputs/nope")
    assert str(refused.value) == (
        f"trainer.resume_from=outputs/nope: no such folder (relative to {tmp_path}); give the run folder of the "
        "stopped run (outputs/<date>/<time>) or one of its checkpoints/update_<k>/"
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(MiniverlError, match=r"^trainer.resume_from=empty: neither a checkpoint folder"):
        checkpoint.resolve_checkpoint("empty")
    (tmp_path / "empty" / "plan.json").write_text("{}")  # a run killed in update 1, before its first checkpoint
    with pytest.raises(MiniverlError) as refused:
        checkpoint.resolve_checkpoint("empty")
    assert str(refused.value) == (
        "trainer.resume_from=empty: that run stopped before its first checkpoint, so nothing is left to resume; run "
        "the command that started it again (with hydra.run.dir=empty it starts again in that folder, from where that "
        "command started)"
    )


def test_the_kernel_environment_names_what_changed_and_how_to_compute_as_before():
    before = {"device": "cpu", "torch_threads": 2, "aten_cpu_capability": "AVX512", "onednn_max_cpu_isa": None}
    before |= {"cpu_bf16_instructions": "avx512_bf16", "torch": "2.13.0+cpu", "peft": "0.21.2"}
    assert checkpoint.numerics_changes(before, dict(before)) == []
    assert checkpoint.numerics_changes(None, before) == []  # a checkpoint written before miniverl recorded it
    capped = before | {"aten_cpu_capability": "AVX2", "onednn_max_cpu_isa": "AVX2", "cpu_bf16_instructions": None}
    assert checkpoint.numerics_changes(before, capped) == [
        "aten_cpu_capability AVX512 -> AVX2",
        "cpu_bf16_instructions avx512_bf16 -> None",
        "onednn_max_cpu_isa None -> AVX2",
    ]
    # The ISA cap explains the bf16 instructions it hides: no hint to find another CPU.
    assert checkpoint.numerics_hints(before, capped) == [
        "with ATEN_CPU_CAPABILITY=avx512",
        "without ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA)",
    ]
    elsewhere = before | {"cpu_bf16_instructions": "amx", "torch_threads": 8, "peft": "0.22.0"}
    assert checkpoint.numerics_hints(before, elsewhere) == [
        "on a CPU with avx512_bf16",
        "with peft==0.21.2",
        "with OMP_NUM_THREADS=2",
    ]
