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
    (tmp_path / "empty" / "report.json").write_text('{"status": "interrupted"}')  # stopped, checkpoints/ removed
    with pytest.raises(MiniverlError) as refused:
        checkpoint.resolve_checkpoint("empty")
    assert str(refused.value) == (
        "trainer.resume_from=empty: that run's checkpoints/ is gone (removed or moved), so nothing is left to "
        "resume; start the run anew: in another hydra.run.dir, or in empty with trainer.overwrite=true"
    )
