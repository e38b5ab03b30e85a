"""Several teachers routed by data_source, end to end on the toy (verl's multi-teacher
distillation): each sample is scored by the teacher of its row's key, and by no other; each toy
teacher learned only its own rows; the metrics and the report name every teacher; a run stopped
and resumed trains the same bytes; a row no teacher takes is one line, or goes to the default."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from miniverl.config import to_config
from miniverl.models import cpu_gemm
from miniverl.models import loading as models
from miniverl.protocol import Batch
from miniverl.trainer.runner import run
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import sha256_file
from miniverl.workers.teacher import TeacherWorker

from conftest import compose_config, trajectory

NAMES = ("arithmetic", "echo")  # the recipe's teachers, in teacher_index order
KEYS = {"miniverl/toy_arithmetic": "arithmetic", "miniverl/toy_echo": "echo"}
ARGS = [
    "+recipe=opd_k1_two_teachers_toy",
    "recipe.optimizer_updates=2",
    "recipe.logical_batch=4",
    "recipe.response_limit=8",
    "eval.every=-1",
    "data.val_files=[]",
    "teachers.arithmetic.toy_pretrain_steps=3",
    "teachers.echo.toy_pretrain_steps=3",
    "trainer.progress_bar=false",
]


def teachers_run(run_dir, *extra):
    return run(compose_config([*ARGS, *extra]), run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("teachers") / "run"
    assert teachers_run(run_dir)["status"] == "measured"
    return run_dir


def as_batch(t: dict) -> Batch:
    return Batch(**{k: v for k, v in t.items() if k in Batch.__dataclass_fields__})


def alone(cfg, name: str, run_dir) -> TeacherWorker:
    """A teacher of the run loaded by itself, as the run loads it (NF4, the CPU's float32 products)."""
    block, device = cfg.teachers[name], torch.device("cpu")
    model = models.load_teacher(block, models.source_of(block, run_dir / "toy_models" / "teachers" / name), device)
    return TeacherWorker(
        model,
        logprob_chunk=cfg.hardware.logprob_chunk,
        topk=None,
        float32_gemm=cpu_gemm.enabled_for(cfg.hardware, device),
    )


@pytest.mark.slow
def test_each_sample_is_scored_by_the_teacher_of_its_data_source(reference):
    sources = pq.read_table("data/toy_mixed.parquet").column("data_source").to_pylist()
    cfg = to_config(compose_config(ARGS))
    workers = {name: alone(cfg, name, reference) for name in NAMES}
    for update in (1, 2):
        t = trajectory(reference, update)
        routed = [NAMES[i] for i in t["teacher_index"].tolist()]
        assert routed == [KEYS[sources[row]] for row in t["prompt_rows"].tolist()]
        assert set(routed) == set(NAMES)  # both teachers score in every update of this mix
        # Each teacher alone on the whole batch: the rows routed to it carry its log-probs.
        scored = {n: w.compute_teacher_log_prob(as_batch(t), len(routed)).teacher_logprobs for n, w in workers.items()}
        for i, name in enumerate(routed):
            other = NAMES[1 - NAMES.index(name)]
            torch.testing.assert_close(t["teacher_logprobs"][i], scored[name][i], atol=1e-5, rtol=0)
            assert (t["teacher_logprobs"][i] - scored[other][i]).abs().max() > 1e-2  # not the other's


def test_each_toy_teacher_learned_only_its_own_rows(reference):
    a, b = (load_file(str(reference / "toy_models" / "teachers" / n / "model.safetensors")) for n in NAMES)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # the same start, different corpora


def test_the_metrics_and_the_report_name_every_teacher(reference):
    history = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    for update, metrics in enumerate(history, start=1):
        t = trajectory(reference, update)
        loss = -t["advantages"]  # the PG-k1 per-token loss, after the clamp
        for i, name in enumerate(NAMES):
            rows = t["teacher_index"] == i
            mask = t["response_mask"][rows]
            expected = float((loss[rows] * mask).sum() / mask.sum())
            assert metrics[f"actor/distillation/loss/{name}"] == pytest.approx(expected, rel=1e-5)
    report = json.loads((reference / "report.json").read_text())
    models = report["models"]
    assert "teacher" not in models and models["teacher_key"] == "data_source" and models["default_teacher"] is None
    assert {n: models["teachers"][n]["key"] for n in NAMES} == {v: k for k, v in KEYS.items()}
    for name in NAMES:
        weights = load_file(str(reference / "toy_models" / "teachers" / name / "model.safetensors"))
        # NF4: the packed linear weights and their scales, far below the float32 file.
        stored = sum(w.numel() * w.element_size() for w in weights.values())
        assert 0 < models["teachers"][name]["weight_bytes"] < stored
    plan = json.loads((reference / "plan.json").read_text())
    assert "teacher" not in plan["settings"] and set(plan["settings"]["teachers"]) == set(NAMES)


@pytest.mark.slow
def test_a_run_stopped_and_resumed_with_several_teachers_equals_the_whole_run(reference, tmp_path):
    stopped = tmp_path / "stopped"
    assert teachers_run(stopped, "trainer.stop_after_updates=1")["status"] == "interrupted"
    assert teachers_run(stopped)["status"] == "measured"  # resume_mode=auto: goes on in its own folder
    for name in ("trajectories/update_000001.safetensors", "trajectories/update_000002.safetensors",
                 "peft_adapter/adapter_model.safetensors"):  # fmt: skip
        assert sha256_file(stopped / name) == sha256_file(reference / name)


def mixed_with(tmp_path, source: str):
    rows = pq.read_table("data/toy_mixed.parquet").to_pylist()[:8]
    rows[3]["data_source"] = source
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_a_row_whose_key_matches_no_teacher_is_one_line_naming_the_row(tmp_path):
    path = mixed_with(tmp_path, "my/benchmark")
    message = (
        r"data.train_files row 3: data_source='my/benchmark' matches no teacher's key \(arithmetic: "
        r"'miniverl/toy_arithmetic', echo: 'miniverl/toy_echo'\); add a teacher"
    )
    with pytest.raises(MiniverlError, match=message):
        teachers_run(tmp_path / "run", f"data.train_files={path}")
    assert not (tmp_path / "run").exists()  # refused before writing anything
    path = mixed_with(tmp_path, None)
    with pytest.raises(MiniverlError, match=r"row 3: no data_source \(null\), so no teacher's key .* fill it"):
        teachers_run(tmp_path / "run", f"data.train_files={path}")
    with pytest.raises(MiniverlError, match="column 'extra_info' holds lists or structs; teacher_key routes by"):
        teachers_run(tmp_path / "run", "teacher_key=extra_info")


def test_the_default_teacher_takes_a_row_of_no_key_and_a_ref_teacher_is_the_students_own_base(tmp_path):
    path = mixed_with(tmp_path, "my/benchmark")
    run_dir = tmp_path / "run"
    extra = ["default_teacher=echo", "teachers.echo.mode=ref", "recipe.optimizer_updates=1"]
    report = teachers_run(run_dir, f"data.train_files={path}", *extra)
    t = trajectory(run_dir, 1)
    routed = dict(zip(t["prompt_rows"].tolist(), t["teacher_index"].tolist()))
    assert routed[3] == NAMES.index("echo")
    sources = pq.read_table(path).column("data_source").to_pylist()
    assert all(NAMES[i] == KEYS[sources[row]] for row, i in routed.items() if row != 3)
    # Update 1 samples from the base with a fresh LoRA (B = 0): the ref teacher's rows give k1 ~ 0.
    k1 = (t["rollout_log_probs"] - t["teacher_logprobs"]).abs() * t["response_mask"]  # (B, R)
    echo = t["teacher_index"] == NAMES.index("echo")
    assert k1[echo].max() < 1e-3 and k1[~echo].max() > 0.1
    assert report["models"]["teachers"]["echo"]["weight_bytes"] == 0  # no second copy of any weight
    assert not (run_dir / "toy_models" / "teachers" / "echo").exists()


@pytest.mark.slow
def test_the_full_vocabulary_kl_of_each_sample_is_against_its_own_teachers_distribution(tmp_path):
    """estimator=reverse_kl_full with two teachers: each teacher's loss metric is the exact KL of the
    student (a fresh LoRA: its base) to that teacher alone, over that teacher's samples."""
    from miniverl.workers.logprobs import full_log_probs

    run_dir = tmp_path / "run"
    extra = ["estimator=reverse_kl_full", "recipe.optimizer_updates=1"]
    assert teachers_run(run_dir, *extra)["status"] == "measured"
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    t = trajectory(run_dir, 1)
    assert "teacher_hidden_states" not in t  # dropped after the update: never in the trajectory log
    cfg, device = to_config(compose_config([*ARGS, *extra])), torch.device("cpu")
    source = models.source_of(cfg.model, run_dir / "toy_models" / "student")
    vocab = len(models.load_tokenizer("model", cfg.model, source))
    student = models.load_student(cfg.model, source, device, lora_seed=0).get_base_model()  # LoRA B = 0
    batch, float32_gemm = as_batch(t), cpu_gemm.enabled_for(cfg.hardware, device)
    with torch.no_grad(), cpu_gemm.float32_products(student, float32_gemm):
        log_pi = full_log_probs(student, batch, vocab)  # (B, R, V)
    for i, name in enumerate(NAMES):
        block = cfg.teachers[name]
        model = models.load_teacher(block, models.source_of(block, run_dir / "toy_models" / "teachers" / name), device)
        worker = TeacherWorker(model, logprob_chunk=64, topk=None, tokenizer_vocab=vocab, float32_gemm=float32_gemm)
        rows = (batch.teacher_index == i).nonzero(as_tuple=True)[0]
        log_nu = worker.compute_full_log_probs(batch.select(rows))
        kl = (log_pi[rows].exp() * (log_pi[rows] - log_nu)).sum(-1)  # (b, R)
        mask = batch.response_mask[rows]
        assert metrics[f"actor/distillation/loss/{name}"] == pytest.approx(
            float((kl * mask).sum() / mask.sum()), rel=2e-3
        )


@pytest.mark.slow
def test_a_teachers_block_of_one_scores_every_row_whatever_its_key_as_the_single_teacher_does(tmp_path):
    """verl accepts one named teacher entry and serves it every sample (its key routes nothing): a
    `teachers` block of one trains exactly as the same teacher in `teacher` does."""
    args = ["+recipe=opd_k1_toy_distill", "recipe.optimizer_updates=2", "eval.every=-1", "data.val_files=[]",
            "teacher.toy_pretrain_steps=3", "trainer.progress_bar=false"]  # fmt: skip
    named = [
        "+teacher@teachers.only=toy",
        "teachers.only.key=no/row/has/this",  # verl requires a key of a named entry; it routes nothing here
        "teachers.only.toy_teacher_seed=null",
        "teachers.only.toy_pretrain_steps=3",
        "teachers.only.toy_pretrain_lr=0.003",
    ]
    assert run(compose_config(args), tmp_path / "single")["status"] == "measured"
    assert run(compose_config([*args, *named]), tmp_path / "named")["status"] == "measured"
    for update in (1, 2):
        single, one = trajectory(tmp_path / "single", update), trajectory(tmp_path / "named", update)
        assert torch.equal(single["teacher_logprobs"], one["teacher_logprobs"])
        assert torch.equal(single["responses"], one["responses"])
    single = load_file(str(tmp_path / "single" / "peft_adapter" / "adapter_model.safetensors"))
    named_adapter = load_file(str(tmp_path / "named" / "peft_adapter" / "adapter_model.safetensors"))
    assert single.keys() == named_adapter.keys() and all(torch.equal(single[k], named_adapter[k]) for k in single)
