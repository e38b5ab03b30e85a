"""The NF4 cache (hardware.nf4_cache, models/nf4_cache.py): a model folder is quantized once, later
loads read the same bits back without quantizing, the adapter still names the user's folder, and
an entry is replaced when its folder's weights change, rebuilt when damaged, never made for a toy."""

from __future__ import annotations

import json
import shutil

import bitsandbytes as bnb
import pytest
import torch

from miniverl.config import to_config
from miniverl.config.model import StudentConfig
from miniverl.config.teacher import TeacherConfig
from miniverl.models import loading as models
from miniverl.models import nf4_cache
from miniverl.trainer.plan import experiment_settings
from miniverl.utils.checkpoint import save_adapter

from conftest import compose_config, toy_model_folders

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVERL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "nf4"


@pytest.fixture
def folder(tmp_path):
    return toy_model_folders(tmp_path / "users")["teacher"]


def load(folder, use_cache=True):
    block = TeacherConfig(model_id=str(folder))
    return models.load_teacher(block, models.source_of(block, None), CPU, use_nf4_cache=use_cache)


def no_quantizing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("quantized again")

    monkeypatch.setattr(bnb.functional, "quantize_4bit", refuse)


def test_a_second_load_reads_the_same_bits_back_without_quantizing(cache, folder, monkeypatch, capsys):
    fresh = load(folder, use_cache=False)
    assert not cache.exists()  # off: nothing written
    first = load(folder)
    (entry,) = cache.iterdir()
    assert "cached in" in capsys.readouterr().err
    assert json.loads((entry / nf4_cache.RECORD).read_text()) == {"source": str(folder)}
    no_quantizing(monkeypatch)
    with pytest.raises(RuntimeError, match="conversion"):  # the patch reaches transformers' quantizer
        load(folder, use_cache=False)
    again = load(folder)
    ours, theirs = fresh.state_dict(), again.state_dict()
    assert ours.keys() == theirs.keys() and len([k for k in ours if k.endswith(".absmax")]) == 2 * 7
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, again(input_ids=ids).logits)
        assert torch.equal(first(input_ids=ids).logits, again(input_ids=ids).logits)
    assert again.name_or_path == again.config.name_or_path == str(folder)  # not the cache's folder
    assert again.generation_config.to_dict() == fresh.generation_config.to_dict()


def test_a_student_from_the_cache_saves_an_adapter_that_names_the_users_folder(cache, folder, tmp_path):
    block = StudentConfig(model_id=str(folder))
    for _ in range(2):  # the second from the cache
        student = models.load_student(block, models.source_of(block, None), CPU, lora_seed=0)
    assert len(list(cache.iterdir())) == 1
    save_adapter(student, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        folder
    )


def test_weights_saved_again_in_the_folder_replace_the_entry(cache, tmp_path, monkeypatch):
    folders = toy_model_folders(tmp_path)
    load(folders["teacher"])
    (old,) = cache.iterdir()
    shutil.copytree(folders["student"], folders["teacher"], dirs_exist_ok=True)  # another model, the same folder
    load(folders["teacher"])
    (new,) = cache.iterdir()
    assert new != old
    no_quantizing(monkeypatch)
    assert load(folders["teacher"]).config.hidden_size == 64  # the student's width, read back from the new entry


def test_a_damaged_entry_is_quantized_again_and_a_toy_is_never_cached(cache, folder, tmp_path):
    load(folder)
    (entry,) = cache.iterdir()
    (entry / "model.safetensors").write_bytes(b"not tensors")
    fresh = load(folder, use_cache=False)
    rebuilt = load(folder)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), rebuilt.state_dict().values()))
    assert (entry / "model.safetensors").stat().st_size > 1000  # written again
    toy_folder = models.materialize_toys(StudentConfig(), {}, tmp_path / "toys", student_seed=1)["student"]
    models.load_student(StudentConfig(), models.source_of(StudentConfig(), toy_folder), CPU, lora_seed=0)
    assert len(list(cache.iterdir())) == 1


def test_the_setting_is_not_part_of_the_plan_a_resume_compares():
    on, off = (to_config(compose_config([f"hardware.nf4_cache={v}"])) for v in ("true", "false"))
    assert experiment_settings(on) == experiment_settings(off)
