"""The NF4 cache (hardware.nf4_cache, models/nf4_cache.py): a model folder is quantized once, later
loads read the same bits back without quantizing, the adapter still names the user's folder; an entry
is replaced when its folder's weights or the package releases change, rebuilt when damaged (even where
it still loads), never made for a toy or a checkpoint saved quantized; a full disk is a notice."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import bitsandbytes as bnb
import huggingface_hub
import pytest
import torch

from miniverl.config import to_config
from miniverl.config.model import StudentConfig
from miniverl.config.teacher import TeacherConfig
from miniverl.models import loading as models
from miniverl.models import nf4_cache
from miniverl.trainer.plan import experiment_settings
from miniverl.utils.checkpoint import save_adapter
from miniverl.utils.errors import MiniverlError

from conftest import compose_config, toy_model_folders

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVERL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "nf4"


@pytest.fixture
def folder(tmp_path):
    return toy_model_folders(tmp_path / "users")["teacher"]


def load(folder, use_cache=True, device=CPU, **settings):
    block = TeacherConfig(model_id=str(folder), **settings)
    return models.load_teacher(block, models.source_of(block, None), device, use_nf4_cache=use_cache)


def no_quantizing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("quantized again")

    monkeypatch.setattr(bnb.functional, "quantize_4bit", refuse)


def test_a_second_load_reads_the_same_bits_back_without_quantizing(cache, folder, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=nf4_cache.__name__)  # the console and main.log: what is written
    main_log = logging.FileHandler(tmp_path / "main.log")  # as Hydra's: a read is said in main.log alone
    logging.getLogger().addHandler(main_log)
    fresh = load(folder, use_cache=False)
    assert not cache.exists()  # off: nothing written
    first = load(folder)
    (entry,) = cache.iterdir()
    assert f"the NF4 weights of {folder} are cached in {entry}" in caplog.text
    assert json.loads((entry / nf4_cache.RECORD).read_text())["source"] == str(folder)
    no_quantizing(monkeypatch)
    with pytest.raises(RuntimeError, match="conversion"):  # the patch reaches transformers' quantizer
        load(folder, use_cache=False)
    try:
        again = load(folder)
    finally:
        logging.getLogger().removeHandler(main_log)
        main_log.close()
    said = f"the NF4 weights of {folder} read from {entry}"
    assert said in (tmp_path / "main.log").read_text() and said not in caplog.text
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_entry_holds_what_cuda_quantized_and_loads_back_the_same_bits(cache, folder, monkeypatch):
    cuda = torch.device("cuda")
    load(folder)  # the CPU's entry: another kernel environment, not read on CUDA
    fresh = load(folder, use_cache=False, device=cuda)
    load(folder, device=cuda)
    assert len(list(cache.iterdir())) == 2  # the CPU's and CUDA's, side by side
    no_quantizing(monkeypatch)
    again = load(folder, device=cuda)
    ours, theirs = fresh.state_dict(), again.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert {p.device.type for p in again.parameters()} == {"cuda"}


def test_a_hub_models_entry_is_keyed_on_the_weights_its_first_load_downloaded(cache, folder, tmp_path, monkeypatch):
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--someorg--toy"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for file in folder.iterdir():
        if file.name != "model.safetensors":  # what a first start has fetched before the weights
            shutil.copy(file, snapshot / file.name)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    load_from = models.AutoModelForCausalLM.from_pretrained

    def downloading(path, *args, **kwargs):
        if str(path) == "someorg/toy":
            shutil.copy(folder / "model.safetensors", snapshot / "model.safetensors")
        return load_from(path, *args, **kwargs)

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", downloading)
    load("someorg/toy")
    (entry,) = cache.iterdir()
    assert entry.name.startswith("someorg--toy-")
    no_quantizing(monkeypatch)
    assert load("someorg/toy").name_or_path == "someorg/toy"  # the second start reads what the first wrote


def test_a_student_from_the_cache_saves_an_adapter_that_names_the_users_folder(cache, folder, tmp_path):
    block = StudentConfig(model_id=str(folder))
    for _ in range(2):  # the second from the cache
        student = models.load_student(block, models.source_of(block, None), CPU, lora_seed=0)
    assert len(list(cache.iterdir())) == 1
    save_adapter(student, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        folder
    )


def test_weights_saved_again_in_the_folder_replace_the_entry_and_other_dtypes_keep_theirs(cache, tmp_path, monkeypatch):
    folders = toy_model_folders(tmp_path)
    load(folders["teacher"])
    load(folders["teacher"], dtype="bfloat16")  # another compute dtype: an entry of its own, beside the first
    assert len(list(cache.iterdir())) == 2
    shutil.copytree(folders["student"], folders["teacher"], dirs_exist_ok=True)  # another model, the same folder
    load(folders["teacher"])
    (new,) = cache.iterdir()  # both of the old weights' entries removed
    weights = folders["teacher"] / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # edited in place
    load(folders["teacher"])
    (newer,) = cache.iterdir()
    assert newer != new
    no_quantizing(monkeypatch)
    assert load(folders["teacher"]).config.hidden_size == 64  # the student's width, read back from the entry


def test_a_damaged_entry_is_replaced_and_a_mistake_in_the_settings_leaves_a_whole_one(cache, folder, tmp_path):
    load(folder)
    (entry,) = cache.iterdir()
    with pytest.raises(MiniverlError, match="teacher.attn_implementation='bogus'"):  # as without the cache
        load(folder, attn_implementation="bogus")
    assert (entry / "config.json").is_file() and len(list(cache.iterdir())) == 1
    weights = entry / "model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[len(damaged) // 2 : len(damaged) // 2 + 4096] = bytes(4096)  # still loads, as other numbers
    weights.write_bytes(bytes(damaged))
    fresh = load(folder, use_cache=False)
    rebuilt = load(folder)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), rebuilt.state_dict().values()))
    assert nf4_cache.whole(nf4_cache.Entry(entry, "")) and weights.read_bytes() != bytes(damaged)  # written again
    toy_folder = models.materialize_toys(StudentConfig(), {}, tmp_path / "toys", student_seed=1)["student"]
    models.load_student(StudentConfig(), models.source_of(StudentConfig(), toy_folder), CPU, lora_seed=0)
    assert len(list(cache.iterdir())) == 1  # a toy is never cached


def test_a_cache_that_cannot_be_written_costs_only_the_next_quantization(cache, folder, monkeypatch, caplog):
    def full_disk(*args, **kwargs):
        raise RuntimeError("Error while serializing: I/O error: No space left on device")  # safetensors' own

    monkeypatch.setattr(nf4_cache, "write_atomically", full_disk)
    model = load(folder)
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "were not cached in" in r.getMessage()]
    assert len(warned) == 1 and model.config.name_or_path == str(folder)


def test_an_entry_of_a_folder_gone_for_a_week_is_removed_when_another_is_written(cache, tmp_path):
    users = toy_model_folders(tmp_path / "users")
    gone = toy_model_folders(tmp_path / "gone")
    load(gone["teacher"]), load(gone["student"])
    shutil.rmtree(tmp_path / "gone")
    entries = sorted(cache.iterdir())
    week_ago = time.time() - (nf4_cache.STALE_DAYS + 1) * 86400
    os.utime(entries[0] / nf4_cache.RECORD, (week_ago, week_ago))  # unread for a week; the other read today
    load(users["teacher"])
    assert sorted(cache.iterdir()) == sorted([entries[1], *(e for e in cache.iterdir() if e not in entries)])
    assert len(list(cache.iterdir())) == 2


def test_another_package_release_replaces_the_sources_entry_and_a_model_card_changes_nothing(
    cache, folder, monkeypatch
):
    load(folder)
    (first,) = cache.iterdir()
    (folder / "README.md").write_text("# my model\n")  # not part of the weights (nor of the plan's digest)
    capped = nf4_cache.numerics_environment
    other = "SSE41" if capped(CPU)["onednn_max_cpu_isa"] == "AVX2" else "AVX2"  # under the AVX2 caps too
    monkeypatch.setattr(nf4_cache, "numerics_environment", lambda d: {**capped(d), "onednn_max_cpu_isa": other})
    load(folder)  # another CPU mode on this machine: both kept
    assert len(list(cache.iterdir())) == 2 and first.is_dir()
    monkeypatch.setattr(nf4_cache, "numerics_environment", lambda d: {**capped(d), "bitsandbytes": "9.9.9"})
    load(folder)  # an upgrade: the older release's entries go (no start reads them again)
    (upgraded,) = cache.iterdir()
    assert json.loads((upgraded / nf4_cache.RECORD).read_text())["packages"]["bitsandbytes"] == "9.9.9"


def test_a_pre_quantized_checkpoint_is_not_cached_and_a_killed_writers_folder_goes_after_a_day(
    cache, folder, tmp_path, caplog
):
    load(folder)
    (entry,) = cache.iterdir()
    quantized = tmp_path / "bnb-4bit"  # what a `-bnb-4bit` repository holds: loads without quantizing
    shutil.copytree(entry, quantized)
    for tokenizer_file in folder.glob("tokenizer*"):
        shutil.copy(tokenizer_file, quantized)
    staging = [cache / f"{entry.name}.killed{i}" for i in range(2)]
    for day, leftover in zip((2, 0), staging):
        leftover.mkdir()
        os.utime(leftover, (time.time() - day * 86400,) * 2)
    load(quantized)
    load(quantized, quantization="none")  # loads as saved too (given quantization_config=None, it refused)
    assert sorted(cache.iterdir()) == [entry, *staging] and "not cached" not in caplog.text  # nothing tried
    load(folder, dtype="bfloat16")  # a write: the day-old leftover removed, today's kept (it may be writing)
    assert staging[1] in cache.iterdir() and not staging[0].exists() and len(list(cache.iterdir())) == 3


def test_the_setting_is_not_part_of_the_plan_a_resume_compares():
    on, off = (to_config(compose_config([f"hardware.nf4_cache={v}"])) for v in ("true", "false"))
    assert experiment_settings(on) == experiment_settings(off)
