"""Saving the adapter of an offline run: no hub look-up, no warning, the same files."""

from __future__ import annotations

import json
import warnings

import pytest
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


def test_the_adapters_config_lists_its_target_modules_in_one_order_whatever_the_process(tmp_path):
    student = _student("Qwen/Qwen3-0.6B")
    # peft keeps them in a set, written in the process's string-hash order (PYTHONHASHSEED): two runs of
    # one command wrote adapter_config.json in two orders (the adapter's weights the same bytes).
    names = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]  # 1 order in 5,040 sorted
    student.peft_config["default"].target_modules = set(names)
    checkpoint.save_adapter(student, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == names and config["r"] == 4


def test_lora_on_the_output_layer_saves_it_whole():
    student = _student("Qwen/Qwen3-0.6B")
    assert not checkpoint.embeddings_targeted(student)
    student.peft_config["default"].target_modules = {"q_proj", "lm_head"}
    assert checkpoint.embeddings_targeted(student)


@pytest.mark.parametrize(
    "save_freq,stop,expected",
    [
        (1, None, [1, 2, 3, 4, 5, 6]),
        (-1, None, [6]),  # the last update only
        (-1, 2, [2, 6]),  # a stop keeps its update resumable, whatever save_freq says
        (4, 3, [3, 4, 6]),
    ],
)
def test_a_checkpoint_follows_every_save_freq_updates_the_stop_and_the_last(save_freq, stop, expected):
    """(a tests audit: every run of the suite saved each update, so a stop without its checkpoint passed)"""
    from miniverl.config.trainer import TrainerConfig
    from miniverl.utils.checkpoint import is_due

    config = TrainerConfig(save_freq=save_freq, stop_after_updates=stop)
    assert [update for update in range(1, 7) if is_due(update, config, 6)] == expected


@pytest.mark.parametrize(
    "keep,newest,left",
    [
        (2, 5, [4, 5]),  # the newest two
        (None, 5, [1, 2, 3, 4, 5]),  # every one
        (1, 3, [3]),  # resumed at update 2 of a run that reached 5: its 4 and 5 go, and so does 2
        (None, 3, [1, 2, 3]),
        (2, 1, [1]),
    ],
)
def test_pruning_keeps_the_checkpoint_just_written_and_drops_a_replaced_runs_later_ones(tmp_path, keep, newest, left):
    """A run resumed at an earlier checkpoint of its folder kept the earlier run's higher-numbered
    checkpoints and deleted the one it had just written (an audit: its own and the resumed-from one
    went, and the next auto resume would have taken the earlier run's update 5)."""
    for update in range(1, 6):
        (tmp_path / "checkpoints" / f"update_{update}").mkdir(parents=True)
    checkpoint.prune(tmp_path, keep, newest)
    assert [checkpoint.checkpoint_update(c) for c in checkpoint.checkpoints_in(tmp_path)] == left
