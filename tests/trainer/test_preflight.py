"""Pre-flight checks and the distillation-progress measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from miniverl.config import to_config
from miniverl.models import toy
from miniverl.trainer import model_checks, preflight
from miniverl.trainer.runner import run
from miniverl.utils.errors import MiniverlError

from conftest import ROOT, SHORT, compose_config, run_as_command

BASE = ["+recipe=opd_k1", "model=toy", "teacher=toy"]


def checks_of(*overrides):
    import torch

    return {
        c.name: c for c in preflight.cheap_checks(to_config(compose_config([*BASE, *overrides])), torch.device("cpu"))
    }


def tokenizer_folder(tmp_path, edit):
    tokenizer = toy.build_toy_tokenizer()
    edit(tokenizer)
    tokenizer.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def test_a_teacher_with_another_vocabulary_fails(tmp_path):
    folder = tokenizer_folder(tmp_path, lambda t: t.add_tokens(["<extra>"]))
    check = checks_of(f"teacher.tokenizer_id={folder}")["tokenizer"]
    assert check.status == "FAIL" and "vocabularies differ: student 259 tokens, teacher 260" in check.reason


def test_a_teacher_that_names_another_pad_token_passes_and_one_with_another_eos_fails(tmp_path):
    """The same vocabulary, another token as padding: the teacher is given the student's pad id and padded
    positions are masked, so it scores alike (an audit: such a teacher folder was refused). Another EOS
    ends responses otherwise: refused."""

    def pad_with_im_start(t):
        t.pad_token = toy.IM_START

    def end_with_im_start(t):
        t.eos_token = toy.IM_START

    check = checks_of(f"teacher.tokenizer_id={tokenizer_folder(tmp_path / 'pad', pad_with_im_start)}")["tokenizer"]
    assert check.status == "PASS" and "eos, and chat template output identical" in check.reason
    check = checks_of(f"teacher.tokenizer_id={tokenizer_folder(tmp_path / 'eos', end_with_im_start)}")["tokenizer"]
    assert check.status == "FAIL"
    assert f"special tokens differ: eos_token '<|im_end|>' vs '{toy.IM_START}'" in check.reason


def test_a_teacher_with_another_chat_template_fails(tmp_path):
    def other_template(t):
        t.chat_template = t.chat_template.replace("<|im_start|>assistant", "<|im_start|>bot")

    folder = tokenizer_folder(tmp_path, other_template)
    check = checks_of(f"teacher.tokenizer_id={folder}")["tokenizer"]
    assert check.status == "FAIL" and "chat templates render the probe conversation differently" in check.reason


def test_a_teacher_whose_template_differs_only_in_its_default_system_prompt_fails(tmp_path):
    """Qwen2.5's template against Qwen2's: alike with a system message (the old probe), not without one (the
    data's rows). A new-user audit's pair passed as identical, and text alignment was then skipped."""

    def default_system(t):
        default = "{%- if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen.<|im_end|>\n{%- endif %}"
        t.chat_template = default + t.chat_template

    folder = tokenizer_folder(tmp_path, default_system)
    check = checks_of(f"teacher.tokenizer_id={folder}")["tokenizer"]
    assert check.status == "FAIL" and "render the probe conversation without a system message differently" in (
        check.reason
    )
    assert "You are Qwen." in check.reason  # where they part


def base_release(tmp_path):
    """Toy student and teacher folders, the student's written as a base release is (Qwen's): its EOS and its
    generation config's <|endoftext|>, not its template's end of turn <|im_end|>; one vocabulary."""
    import json

    from transformers import AutoTokenizer

    from conftest import toy_model_folders

    folders = toy_model_folders(tmp_path / "models")
    student = folders["student"]
    tokenizer = AutoTokenizer.from_pretrained(student)
    tokenizer.eos_token = "<|endoftext|>"
    tokenizer.save_pretrained(student)
    generation = json.loads((student / "generation_config.json").read_text())
    generation["eos_token_id"] = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    (student / "generation_config.json").write_text(json.dumps(generation))
    return student, folders["teacher"]


def test_the_students_own_stop_ids_are_checked_whatever_its_teachers_mode(tmp_path):
    """A new-user audit's student whose EOS is not its template's end of turn was warned of beside a standard
    teacher, and PASSed with teacher.mode=ref."""
    student, _ = base_release(tmp_path)
    for mode in ("teacher.mode=ref", f"teacher.model_id={student}"):
        check = checks_of(f"model.model_id={student}", mode)["tokenizer"]
        assert check.status == "WARN" and "ends an assistant turn with '<|im_end|>'" in check.reason, (mode, check)


def test_a_base_student_beside_an_instruct_teacher_is_told_to_share_one_tokenizer_not_to_align_text(tmp_path):
    """A model-families audit: a base student (Qwen2.5's EOS) and the instruct teacher of its family, one
    vocabulary, were refused with "set teacher.tokenizer_alignment=text"; doing so PASSed, and the student's
    end of turn was no longer checked. The fix named is the tokenizer's; text alignment still warns."""
    student, teacher = base_release(tmp_path)
    pair = [f"model.model_id={student}", f"teacher.model_id={teacher}"]
    check = checks_of(*pair)["tokenizer"]
    assert check.status == "FAIL" and check.reason.endswith(
        "of one vocabulary; set teacher.tokenizer_id to the student's tokenizer, or model.tokenizer_id to the "
        "teacher's (the student's responses then end at the teacher's end of turn)"
    )
    assert "tokenizer_alignment" not in check.reason
    check = checks_of(*pair, f"model.tokenizer_id={teacher}")["tokenizer"]
    assert check.status == "PASS" and "responses end at ids" in check.reason
    check = checks_of(*pair, "teacher.tokenizer_alignment=text")["tokenizer"]
    assert check.status == "WARN" and "ends an assistant turn with '<|im_end|>'" in check.reason


def test_a_teacher_saved_in_4_bits_already_is_said_to_load_as_saved_and_how_that_differs(tmp_path, monkeypatch):
    """A new-user audit: a `-bnb-4bit` checkpoint loads with its own quantization settings (transformers
    warns once, among its other notices), whatever the block says: the doctor says which differ."""
    import shutil

    from miniverl.config.teacher import TeacherConfig
    from miniverl.models import loading

    from conftest import toy_model_folders

    monkeypatch.setenv("MINIVERL_CACHE", str(tmp_path / "cache"))
    folders = toy_model_folders(tmp_path / "models")
    block = TeacherConfig(model_id=str(folders["teacher"]))
    loading.load_teacher(block, loading.source_of(block, None), torch.device("cpu"))  # its NF4 entry: 4 bits
    quantized = tmp_path / "teacher-bnb-4bit"
    shutil.copytree(next((tmp_path / "cache" / "nf4").iterdir()), quantized)
    for tokenizer_file in folders["teacher"].glob("tokenizer*"):
        shutil.copy(tokenizer_file, quantized)
    check = checks_of(f"model.model_id={folders['student']}", f"teacher.model_id={quantized}")["quantization"]
    assert check.status == "PASS" and check.reason.endswith("loads so: NF4, as miniverl quantizes"), check
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"].update(bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype="float16")
    (quantized / "config.json").write_text(json.dumps(config))
    student = f"model.model_id={folders['student']}"
    assert "quantization" not in checks_of(student, f"teacher.model_id={folders['teacher']}")  # full precision
    check = checks_of(student, f"teacher.model_id={quantized}", "teacher.dtype=bfloat16")["quantization"]
    assert check.status == "WARN", check
    said = "is saved quantized and loads so: double quantization True (not False), compute dtype float16 (not bfloat16)"
    assert f"teacher.model_id={quantized} {said}" == check.reason
    check = checks_of(student, f"teacher.model_id={quantized}", "teacher.quantization=none")["quantization"]
    assert check.reason.startswith(f"teacher.model_id={quantized} is saved quantized and loads so: quantized where")
    # The memory estimate counts it as it loads, in 4 bits, whatever the block says.
    from miniverl.trainer.memory_estimate import architecture, weight_bytes

    teacher = to_config(compose_config([*BASE, f"teacher.model_id={quantized}"])).teacher
    saved = architecture("teacher", teacher)
    assert saved["saved_bits"] == 4 and weight_bytes(saved, "none", 2) == weight_bytes(saved, "nf4", 2)
    full = architecture("teacher", to_config(compose_config([*BASE, f"teacher.model_id={folders['teacher']}"])).teacher)
    assert full["saved_bits"] is None and weight_bytes(full, "none", 2) > weight_bytes(full, "nf4", 2)


def test_a_model_with_an_mlp_width_per_layer_is_estimated_not_a_failed_check(tmp_path):
    """A model-families audit: Gemma-3n's config lists one intermediate_size a layer (transformers saves a list
    even when given one number), and the memory check failed on it ("the check itself failed")."""
    from transformers import AutoConfig

    from miniverl.trainer.memory_estimate import architecture, linear_weights

    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    folder = tmp_path / "gemma3n"
    AutoConfig.for_model("gemma3n_text", intermediate_size=[128, 256], **sizes).save_pretrained(folder)
    block = to_config(compose_config([*BASE, f"model.model_id={folder}"])).model
    widths = architecture("model", block)
    assert widths["inter"] == 192  # the sum over the layers is the list's: 2 x 192 = 128 + 256
    assert linear_weights(widths) == 2 * 64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * (128 + 256)


def test_too_few_prompts_fail(tmp_path):
    path = tmp_path / "two.parquet"
    pq.write_table(
        pa.table({"prompt": [[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "2+2?"}]]}), path
    )
    check = checks_of(f"data.train_files={path}")["data"]
    assert check.status == "FAIL" and "2 usable prompts, fewer than recipe.logical_batch=4" in check.reason


def test_a_plan_that_needs_more_prompts_than_the_data_fails_unless_repeats_are_allowed():
    check = checks_of("recipe.optimizer_updates=20")["data"]
    assert check.status == "FAIL" and "80 prompts from 64 usable ones" in check.reason
    assert "data.repeat_prompts=true" in check.reason
    check = checks_of("recipe.optimizer_updates=20", "data.repeat_prompts=true")["data"]
    assert check.status == "WARN" and "the plan consumes 80 prompts from 64 usable ones (2 passes)" in check.reason
    # Batches of 10 from 64 prompts (a review): 6 a pass, 13 updates in 3 passes, rows 60-63 never taken (drop_last).
    check = checks_of("recipe.optimizer_updates=13", "recipe.logical_batch=10", "data.repeat_prompts=true")["data"]
    assert "(3 passes, 4 prompts a pass left out (its last partial batch, as verl drops it))" in check.reason


def test_a_prompt_column_of_plain_strings_warns_naming_the_column(tmp_path):
    """A new-user audit set data.prompt_key=ability by mistake: every row's "qa" trained as the prompt, no word said."""
    path = tmp_path / "mine.parquet"
    rows = [[{"role": "user", "content": f"{i} + {i}?"}] for i in range(8)]
    pq.write_table(pa.table({"prompt": rows, "ability": ["qa"] * 8}), path)
    check = checks_of(f"data.train_files={path}", "data.prompt_key=ability", "recipe.optimizer_updates=2")["data"]
    assert check.status == "WARN" and check.reason.endswith(
        "column 'ability' holds plain strings in 8 rows, each taken as one user message (verl reads lists of "
        "{role, content} messages): check data.prompt_key"
    )
    assert checks_of(f"data.train_files={path}", "recipe.optimizer_updates=2")["data"].status == "PASS"


def test_held_out_files_without_a_probe_are_checked_and_said_to_be_unread(tmp_path):
    """A new-user audit's data.val_files=<missing file> ran and said nothing (eval.every=-1: the probe is off)."""
    missing = checks_of(f"data.val_files={tmp_path}/nope.parquet")["data"]
    assert missing.status == "FAIL" and missing.reason.startswith(f"data.val_files: {tmp_path}/nope.parquet does not")
    unread = checks_of("data.val_files=data/toy_prompts_heldout.parquet")["data"]
    assert unread.status == "WARN" and unread.reason.endswith(
        "data.val_files is not read with eval.every=-1 (eval.every=N measures held-out progress)"
    )
    read = checks_of("data.val_files=data/toy_prompts_heldout.parquet", "eval.every=4")["data"]
    assert read.status == "PASS"


def test_an_overlong_prompt_of_a_second_file_is_named_by_that_file(tmp_path):
    path = tmp_path / "long.parquet"
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "word " * 300}]]}), path)
    check = checks_of(f"data.train_files=[{ROOT}/data/toy_prompts.parquet,{path}]")["data"]
    assert check.status == "FAIL" and f"1 over the limit (first: data.train_files {path} row 0)" in check.reason


def small_machine(monkeypatch, gib: float = 0.001) -> None:
    """psutil's machine memory, as a machine with `gib` GiB reports it."""
    real = preflight.psutil.virtual_memory()
    monkeypatch.setattr(preflight.psutil, "virtual_memory", lambda: real._replace(total=int(gib * 2**30)))


def test_an_estimate_over_the_memory_limit_fails(monkeypatch):
    small_machine(monkeypatch)
    check = checks_of()["memory"]
    assert check.status == "FAIL" and "estimated peak" in check.reason
    assert "against this machine's memory (0.001 GiB)" in check.reason  # it said "(0.0 GiB)"


def test_an_estimate_near_the_memory_limit_warns(monkeypatch):
    """Above 80 % of the limit, a WARN (no test looked at that branch: a tests audit made it PASS unseen)."""
    import re

    peak = float(re.search(r"estimated peak ([\d.]+) GiB", checks_of()["memory"].reason).group(1))
    for share, status in ((0.9, "WARN"), (0.6, "PASS")):
        small_machine(monkeypatch, peak / share)
        assert checks_of()["memory"].status == status, share


@pytest.mark.parametrize("unaligned,status", [(0.0, "PASS"), (0.3, "WARN"), (0.7, "FAIL")])
def test_a_teacher_of_another_tokenizer_warns_below_95_and_fails_below_half_of_tokens_aligned(
    monkeypatch, unaligned, status
):
    from types import SimpleNamespace

    def align(student_tok, ids, *args, **kwargs):  # this share of each text's tokens left unaligned
        return SimpleNamespace(unaligned_student_tokens=round(len(ids) * unaligned))

    monkeypatch.setattr(preflight, "align_response", align)
    cfg = to_config(compose_config([*BASE, "teacher.toy.tokenizer=bpe", "teacher.tokenizer_alignment=text"]))
    check = preflight.check_alignment(cfg, toy.build_toy_tokenizer(), toy.build_toy_tokenizer("bpe"))
    assert check.status == status and "tokens of the training rows' text" in check.reason
    assert ("pick a closer teacher" in check.reason) == (status == "FAIL")


@pytest.mark.parametrize("bf16_arithmetic,status", [(False, "FAIL"), (True, "PASS")])
def test_on_a_gpu_without_bf16_arithmetic_a_bf16_model_is_refused_naming_its_dtype_key(
    monkeypatch, bf16_arithmetic, status
):
    """Before Ampere (a T4: compute capability 7.5) torch only emulates bf16 and bitsandbytes' NF4 kernels
    have fp16 alone (a CUDA review: nothing checked). Checked here with torch.cuda's answers given."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16_arithmetic)
    cfg = to_config(compose_config([*BASE, "model.toy.dtype=bfloat16"]))  # the toy teacher: float32
    check = preflight.check_precision(cfg, torch.device("cuda", 0))
    assert check.status == status
    assert check.reason.startswith("Tesla T4: compute in model bfloat16, teacher float32")
    if status == "FAIL":
        assert check.reason.endswith("compute capability 7.5 has no bf16 arithmetic: set model.dtype=float16")


def test_on_a_gpu_the_estimate_is_held_against_its_free_memory(monkeypatch):
    """A desktop GPU that drives a display holds part of its memory already: the run has what is free
    (a CUDA review: the check read the total)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(0.001 * 2**30), 16 * 2**30))
    check = preflight.check_memory(to_config(compose_config(BASE)), torch.device("cuda", 0))
    assert check.status == "FAIL" and "against the free memory of the GPU's 16 GiB (0.001 GiB)" in check.reason


def test_a_gpu_memory_limit_is_no_limit_on_the_cpu():
    """A new-user audit: hardware.peak_reserved_limit_gib (the most GPU memory the run may reserve, reported
    as met or not) refused a CPU run before it started, against the process's resident memory."""
    check = checks_of("hardware.peak_reserved_limit_gib=0.001")["memory"]
    assert check.status == "PASS" and "against this machine's memory" in check.reason


def test_the_memory_estimate_counts_the_rows_and_chunks_that_run_not_the_sizes_set():
    """A new-user audit: rollout_physical_batch and update_chunk 100000 on the toy were refused at 71.81 GiB,
    though a decode holds the update's 4 samples; a log-prob chunk past its cap of logits counted whole."""
    from miniverl.trainer.memory_estimate import architecture, estimate_peak_bytes
    from miniverl.workers.logprobs import MAX_CHUNK_ELEMENTS

    def estimate(*overrides, heldout_rows=None):
        return estimate_peak_bytes(to_config(compose_config([*BASE, *overrides])), "cpu", heldout_rows)

    assert (
        checks_of("hardware.rollout_physical_batch=100000", "hardware.update_chunk=100000")["memory"].status == "PASS"
    )
    rows = 4  # recipe.logical_batch x rollout.n
    at_rows = estimate(f"hardware.rollout_physical_batch={rows}", f"hardware.update_chunk={rows}")
    assert estimate("hardware.rollout_physical_batch=100000", "hardware.update_chunk=100000") == at_rows
    assert estimate("hardware.rollout_physical_batch=2", "hardware.update_chunk=2") < at_rows  # smaller still counts
    # The held-out probe decodes its prompts at the physical batch: 16 of them make 16 rows, not 100000.
    probed = ["data.val_files=data/toy_prompts_heldout.parquet", "eval.every=2"]
    assert checks_of(*probed, "hardware.rollout_physical_batch=100000")["memory"].status == "PASS"
    assert estimate(*probed, "hardware.rollout_physical_batch=100000", heldout_rows=16) == estimate(
        *probed, "hardware.rollout_physical_batch=16", heldout_rows=16
    )
    vocab = architecture("model", to_config(compose_config(BASE)).model)["vocab"]
    cap = MAX_CHUNK_ELEMENTS // vocab
    assert estimate("hardware.logprob_chunk=100000000") == estimate(f"hardware.logprob_chunk={cap}")
    assert estimate(f"hardware.logprob_chunk={cap - 1}") < estimate(f"hardware.logprob_chunk={cap}")


def test_on_cuda_the_estimate_counts_the_attention_scores_the_deterministic_math_backend_holds():
    """Strict determinism runs attention on the math backend: one layer's (b, heads, L, L) float32 scores,
    their softmax and its gradient (a CUDA review: at long sequences several GiB the estimate left out)."""
    from miniverl.trainer.memory_estimate import architecture, estimate_peak_bytes

    def estimate(*overrides, device="cuda"):
        return estimate_peak_bytes(to_config(compose_config([*BASE, *overrides])), device)

    heads = architecture("model", to_config(compose_config(BASE)).model)["heads"]
    for limits in (["recipe.prompt_limit=64", "recipe.response_limit=64"], ["recipe.response_limit=512"]):
        cfg = to_config(compose_config([*BASE, *limits]))
        tokens, chunk = cfg.recipe.prompt_limit + cfg.recipe.response_limit, min(cfg.hardware.update_chunk, 4)
        fused = estimate(*limits, "hardware.deterministic=false")
        assert estimate(*limits) - fused == 3 * chunk * heads * tokens**2 * 4
        assert estimate(*limits, device="cpu") == estimate(*limits, "hardware.deterministic=false", device="cpu")


@pytest.mark.parametrize("loss", ["forward_kl_topk", "forward_kl_topk_tail", "reverse_kl_topk"])
def test_a_topk_larger_than_the_vocabulary_fails_in_one_line(loss):
    check = checks_of(f"estimator={loss}", "estimator.topk=260")["topk"]  # the toy tokenizer has 259 tokens
    assert check.status == "FAIL" and "\n" not in check.reason
    assert (
        check.reason
        == "estimator.topk=260 is larger than the vocabulary (259 tokens); set estimator.topk to at most 259"
    )
    assert checks_of(f"estimator={loss}", "estimator.topk=259")["topk"].status == "PASS"
    assert "topk" not in checks_of("estimator=k3")  # a loss without a top-k is not checked


def test_the_training_command_stops_on_a_cheap_fail(tmp_path, monkeypatch):
    small_machine(monkeypatch)
    with pytest.raises(MiniverlError, match="pre-flight check failed .* memory: estimated peak"):
        run(compose_config([*BASE, *SHORT]), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # stopped before writing anything


def test_a_teacher_that_cannot_be_read_is_one_line_naming_it_once(tmp_path):
    """Its tokenizer, its positions and the memory estimate (its config.json) fail alike: one reason, both checks."""
    missing = tmp_path / "no_teacher"
    with pytest.raises(MiniverlError) as refused:
        run(compose_config([*BASE, *SHORT, f"teacher.model_id={missing}"]), tmp_path / "run")
    assert str(refused.value) == (
        f"pre-flight check failed (python -m miniverl.doctor shows all): tokenizer, positions, memory: "
        f"teacher.model_id={missing}: no such folder (relative to {Path.cwd()}); give the folder of a Hugging "
        "Face model (config.json, *.safetensors, the tokenizer's files) or a hub id in the Hugging Face cache"
    )


def test_the_self_test_fails_when_scoring_disagrees_with_sampling(tmp_path, monkeypatch):
    from miniverl.trainer.opd_trainer import OPDTrainer

    cfg = compose_config([*BASE, *SHORT])
    trainer = OPDTrainer(to_config(cfg), {}, tmp_path / "run")
    trainer.setup()
    assert model_checks.check_self_test(trainer).status == "PASS"
    import miniverl.workers.teacher as teacher_module

    real = teacher_module.response_log_probs
    monkeypatch.setattr(teacher_module, "response_log_probs", lambda *a, **k: real(*a, **k) + 0.01)  # misaligned
    assert model_checks.check_self_test(trainer).status == "FAIL"


@pytest.mark.slow
def test_progress_is_measured_before_training_and_every_n_updates(tmp_path):
    report = run(
        compose_config(
            [
                "+recipe=opd_k1_toy_distill",
                "recipe.optimizer_updates=4",
                "eval.every=2",
                "recipe.response_limit=12",
                "teacher.toy_pretrain_steps=20",
                "trainer.progress_bar=false",
            ]
        ),
        tmp_path / "run",
    )
    progress = report["distillation_progress"]
    assert [p["update"] for p in progress["k1_mean"]] == [0, 2, 4]
    assert [p["update"] for p in progress["exact_reverse_kl"]] == [0, 2, 4]
    assert all(p["value"] > 0 for p in progress["exact_reverse_kl"])  # a KL of two different models
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "val/distillation/exact_reverse_kl" in lines[1] and "val/distillation/exact_reverse_kl" not in lines[0]
    assert lines[3]["val/distillation/k1_mean"] == progress["k1_mean"][2]["value"]
    # The probe's time under verl's name, on the updates it measured after (outside timing_s/step)
    assert [("timing_s/testing" in line) for line in lines] == [False, True, False, True]
    assert lines[1]["timing_s/testing"] > 0


def test_exact_kl_is_null_above_the_vocabulary_limit_and_the_log_says_what_to_set(tmp_path, caplog):
    report = run(
        compose_config(
            [
                "+recipe=opd_k1_toy_distill",
                "recipe.optimizer_updates=1",
                "eval.every=1",
                "recipe.response_limit=8",
                "eval.exact_kl_max_vocab=100",
                "teacher.toy_pretrain_steps=0",
                "trainer.progress_bar=false",
            ]
        ),
        tmp_path / "run",
    )
    assert report["distillation_progress"]["exact_reverse_kl"] is None
    assert len(report["distillation_progress"]["k1_mean"]) == 2
    said = [r.getMessage() for r in caplog.records if r.name == "miniverl.trainer.validation"]
    assert said == [
        "held-out exact reverse KL not computed: the vocabulary (259) is above eval.exact_kl_max_vocab=100; "
        "set eval.exact_kl_max_vocab=259 to compute it"
    ]


def test_eval_without_held_out_prompts_is_refused():
    with pytest.raises(MiniverlError, match="data.val_files is empty"):
        to_config(compose_config([*BASE, "eval.every=2"]))


@pytest.mark.slow
def test_the_toy_distill_recipe_moves_the_student_toward_the_teacher(tmp_path):
    report = run(
        compose_config(
            ["+recipe=opd_k1_toy_distill", "recipe.optimizer_updates=10", "eval.every=10", "trainer.progress_bar=false"]
        ),
        tmp_path / "run",
    )
    before, after = (p["value"] for p in report["distillation_progress"]["exact_reverse_kl"])
    assert after < 0.7 * before  # measured: 2.23 -> 0.88


def test_the_doctor_says_which_checks_a_cheap_fail_left_out(capfd):
    status = run_as_command("doctor", *BASE, "data.train_files=/nowhere/prompts.parquet")
    last = capfd.readouterr().out.strip().splitlines()[-1]
    assert status == 1
    assert (
        last
        == "doctor: 2/3 checks without FAIL; not run after the FAIL: self-test, nf4-gradients (they load the models)"
    )


def test_a_ctrl_c_during_the_doctors_checks_is_one_line_and_exit_130(capfd, monkeypatch):
    from miniverl.trainer import preflight

    def checking(cfg, device):
        raise KeyboardInterrupt  # as Ctrl-C raises it, mid-check

    monkeypatch.setattr(preflight, "cheap_checks", checking)  # the command's module runs afresh: patch what it calls
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    assert run_as_command("doctor", *BASE) == 130
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert lines == ["miniverl: error: stopped by SIGINT before the last check"]


@pytest.mark.parametrize("prefix", ["", "++"])  # both ways a user writes the key
def test_the_doctor_leaves_a_copied_run_folder_alone_so_the_training_command_can_use_it(tmp_path, capfd, prefix):
    folder = tmp_path / "run"
    assert run_as_command("doctor", *BASE, f"{prefix}hydra.run.dir={folder}") == 0
    out = capfd.readouterr().out
    assert f"doctor: {prefix}hydra.run.dir={folder} left out: the checks build in a temporary folder" in out
    assert not folder.exists()  # else its plan.json would make the training command refuse the folder


def test_with_task_rewards_the_doctor_checks_every_row_can_be_scored(tmp_path):
    cfg = to_config(compose_config(["+recipe=opd_k1_grpo_toy"]))
    assert str(preflight.check_reward(cfg)) == (
        "PASS reward: 64 rows, each with its data_source's rule (miniverl/toy_arithmetic)"
    )
    rows = pq.read_table(ROOT / "data/toy_digit_sums.parquet").to_pylist()
    rows[3]["data_source"] = "my/benchmark"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mixed.parquet")
    cfg = to_config(compose_config(["+recipe=opd_k1_grpo_toy", f"data.train_files={tmp_path / 'mixed.parquet'}"]))
    checks = preflight.cheap_checks(cfg, torch.device("cpu"))
    assert [c.name for c in checks] == ["data", "tokenizer", "memory", "reward"]
    assert checks[-1].status == "FAIL"
    assert "row 3: no task-reward rule for data_source 'my/benchmark'" in checks[-1].reason
    plain = preflight.cheap_checks(to_config(compose_config(["+recipe=opd_k1", *SHORT])), torch.device("cpu"))
    assert "reward" not in [c.name for c in plain]  # pure distillation reads no reward


def test_one_of_several_teachers_with_another_vocabulary_is_not_told_to_set_what_is_then_refused(tmp_path):
    """A new-user audit set teachers.<name>.tokenizer_alignment=text as the line said, and was refused: text
    alignment serves the single teacher only."""
    folder = tokenizer_folder(tmp_path, lambda t: t.add_tokens(["<extra>"]))
    recipe = ["+recipe=opd_k1_two_teachers_toy", f"teachers.echo.tokenizer_id={folder}"]
    check = {c.name: c for c in preflight.cheap_checks(to_config(compose_config(recipe)), torch.device("cpu"))}
    reason = check["tokenizer"].reason
    assert check["tokenizer"].status == "FAIL" and "teachers.echo.tokenizer_alignment" not in reason
    assert reason.endswith("scores text as the single `teacher` only (teacher.tokenizer_alignment=text): each of "
                           "several teachers shares the student's tokenizer")  # fmt: skip


def test_with_several_teachers_the_doctor_checks_every_row_has_one(tmp_path):
    recipe = "+recipe=opd_k1_two_teachers_toy"
    checks = {c.name: c for c in preflight.cheap_checks(to_config(compose_config([recipe])), torch.device("cpu"))}
    # 64 training rows and 16 held-out ones, alternating between the two sources
    assert str(checks["routing"]) == "PASS routing: rows by data_source: arithmetic 40, echo 40"
    tokenizer = checks["tokenizer"]
    assert tokenizer.status == "PASS" and "teachers.arithmetic 259, teachers.echo 259" in tokenizer.reason
    rows = pq.read_table(ROOT / "data/toy_mixed_heldout.parquet").to_pylist()
    rows[5]["data_source"] = "my/benchmark"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "heldout.parquet")
    cfg = to_config(compose_config([recipe, f"data.val_files={tmp_path / 'heldout.parquet'}"]))
    check = preflight.guarded("routing", preflight.check_routing, cfg)
    assert check.status == "FAIL" and check.reason.startswith("data.val_files row 5: data_source='my/benchmark'")
    cfg = to_config(compose_config([recipe, "teacher_key=ability"]))  # another column: its values route
    check = preflight.guarded("routing", preflight.check_routing, cfg)
    assert check.status == "FAIL" and "row 0: ability='math' matches no teacher's key" in check.reason


@pytest.mark.slow
def test_the_model_checks_pass_with_a_shared_base_teacher_whose_adapter_the_student_also_holds(tmp_path):
    """A new-user audit's doctor ended in a traceback for teacher.mode=shared_base: nf4-gradients paired the
    student's parameters with the dense twin's by position, and the teacher's adapter shifted them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from miniverl.doctor import run_checks

    from conftest import toy_model_folders

    student = toy_model_folders(tmp_path / "models")["student"]
    base = AutoModelForCausalLM.from_pretrained(student)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(tmp_path / "adapter")
    overrides = ["+recipe=opd_k1", *SHORT, f"model.model_id={student}", "teacher.mode=shared_base"]
    cfg = to_config(compose_config([*overrides, f"teacher.adapter={tmp_path / 'adapter'}"]))
    checks = {c.name: c for c in run_checks(cfg, tmp_path / "doctor")}
    assert checks["nf4-gradients"].status == "PASS", checks["nf4-gradients"]
    assert checks["self-test"].status in ("PASS", "WARN"), checks["self-test"]
