"""An adapter folder against the base it is loaded on: what peft saves beside LoRA's own weights (an adapted
output or embedding layer whole, modules_to_save) fits; DoRA, another width or a layer the base lacks is
refused in one line; a run folder or a checkpoint given for an adapter is told where its adapter is."""

from __future__ import annotations

import pytest
from peft import LoraConfig, get_peft_model

from miniverl.config.model import ToyArchitecture
from miniverl.models import toy
from miniverl.models.adapters import check_fits, check_folder
from miniverl.utils.checkpoint import save_adapter
from miniverl.utils.errors import MiniverlError


def base(width: int = 64):
    arch = ToyArchitecture(hidden_size=width, intermediate_size=2 * width, dtype="float32")
    return toy.build_toy_model(arch, toy.build_toy_tokenizer(), seed=width)


def saved(tmp_path, name: str, **lora) -> object:
    model = get_peft_model(base(), LoraConfig(r=4, **lora))
    save_adapter(model, tmp_path / name)  # as miniverl saves its own peft_adapter/
    return tmp_path / name


@pytest.mark.parametrize(
    "lora",
    [
        {"target_modules": ["q_proj", "lm_head"]},  # four toy recipes adapt lm_head: saved whole beside its LoRA
        {"target_modules": ["embed_tokens", "v_proj"]},
        {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
    ],
)
def test_an_adapter_with_a_layer_saved_whole_beside_its_lora_fits_its_base(tmp_path, lora):
    """A new-user audit: the toy_distill recipe's own peft_adapter was refused as model.adapter ("adapts
    lm_head.base_layer.weight, which the base model does not have")."""
    check_fits(base(), saved(tmp_path, "a", **lora), "model.adapter")


def test_an_adapter_of_another_width_a_missing_layer_or_dora_is_one_line(tmp_path, caplog):
    folder = saved(tmp_path, "a", target_modules=["q_proj"])
    config = folder / "adapter_config.json"
    config.write_text(config.read_text().replace('"base_model_name_or_path": null', '"base_model_name_or_path": "/x"'))
    wider = base(128)
    wider.name_or_path = str(tmp_path / "another_base")  # not the adapter's: only a fitting adapter is warned of
    with pytest.raises(MiniverlError, match=r"q_proj has 128 features in this base model but 64 in the adapter"):
        check_fits(wider, folder, "model.adapter")
    assert "its shapes fit" not in caplog.text  # a new-user audit: "its shapes fit", then the refusal that they do not
    dora = get_peft_model(base(), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    save_adapter(dora, tmp_path / "dora")  # a traceback before ("not enough values to unpack")
    with pytest.raises(MiniverlError) as refused:
        check_fits(base(), tmp_path / "dora", "model.adapter")
    assert str(refused.value).startswith(f"model.adapter={tmp_path / 'dora'}: a DoRA adapter (use_dora); ")
    shallow = toy.build_toy_model(ToyArchitecture(num_layers=1, dtype="float32"), toy.build_toy_tokenizer(), seed=1)
    deep = get_peft_model(base(), LoraConfig(r=4, target_modules=["q_proj"]))
    assert len(deep.base_model.model.model.layers) > 1
    save_adapter(deep, tmp_path / "deep")
    with pytest.raises(MiniverlError, match=r"adapts model.layers.1.self_attn.q_proj, which the base model does not"):
        check_fits(shallow, tmp_path / "deep", "model.adapter")


def test_a_run_folder_or_a_checkpoint_given_as_the_adapter_is_told_where_the_adapter_is(tmp_path):
    run = tmp_path / "run"
    save_adapter(get_peft_model(base(), LoraConfig(r=4, target_modules=["q_proj"])), run / "peft_adapter")
    with pytest.raises(
        MiniverlError, match=rf"a run's adapter is its peft_adapter/: model.adapter={run}/peft_adapter$"
    ):
        check_folder(str(run), "model.adapter")
    checkpoint = run / "checkpoints" / "update_1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "adapter.safetensors").write_bytes(b"")
    (checkpoint / "state.json").write_text("{}")
    with pytest.raises(MiniverlError, match=rf"a checkpoint goes on with trainer.resume_from={checkpoint}, "):
        check_folder(str(checkpoint), "model.adapter")


def test_an_adapter_trained_on_another_base_of_the_same_shapes_is_warned_of(tmp_path, caplog):
    """A new-user audit's adapter of the 24-layer cut loaded on the 30-layer teacher without a word."""
    import shutil

    from transformers import AutoModelForCausalLM

    tokenizer = toy.build_toy_tokenizer()
    for name, seed in (("a", 1), ("b", 2)):
        toy.save_toy(toy.build_toy_model(ToyArchitecture(dtype="float32"), tokenizer, seed=seed), tokenizer,
                     tmp_path / name, "float32")  # fmt: skip
    shutil.copytree(tmp_path / "a", tmp_path / "a_copy")
    on_a = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tmp_path / "a"), LoraConfig(r=4, target_modules=["q_proj"])
    )
    save_adapter(on_a, tmp_path / "adapter")
    for name, warned in (("a_copy", False), ("b", True)):
        caplog.clear()
        check_fits(AutoModelForCausalLM.from_pretrained(tmp_path / name), tmp_path / "adapter", "model.adapter")
        assert (f"was trained on {tmp_path / 'a'} (its adapter_config.json), not on this base" in caplog.text) == warned
