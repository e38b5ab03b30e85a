"""A teacher that sees what the student does not (`teacher.context`): the teacher scores the
student's sampled response after its own prompt, rendered from the row; positions are aligned on
the response. Checked against a plain Hugging Face forward of the teacher; resumed exactly; in
the ref mode and with the top-k estimator; bad templates, missing fields and overlong teacher
prompts are one line each; the export refuses it unless told to drop it."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from miniverl.config import to_config
from miniverl.models import loading as models
from miniverl.trainer import preflight
from miniverl.trainer.runner import run
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import sha256_file
from miniverl.verl_compat.launch_writer import export

from conftest import ROOT, compose_config, trajectory

HINT = " (The answer is {{ reward_model.ground_truth }}.)"  # the recipe's context, after {{ user }}
ARGS = [
    "+recipe=opd_k1_privileged_toy",
    "recipe.optimizer_updates=2",
    "recipe.logical_batch=4",
    "eval.every=-1",
    "data.val_files=[]",
    "teacher.toy_pretrain_steps=3",
    "trainer.progress_bar=false",
]


def context_run(run_dir, *extra):
    return run(compose_config([*ARGS, *extra]), run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("context") / "run"
    assert context_run(run_dir)["status"] == "measured"
    return run_dir


def test_the_teacher_scores_the_response_after_its_own_prompt_as_a_plain_forward_does(reference):
    rows = pq.read_table(ROOT / "data/toy_digit_sums.parquet").to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(reference / "toy_models" / "student")
    block = to_config(compose_config(ARGS)).teacher
    teacher = models.load_teacher(
        block, models.source_of(block, reference / "toy_models" / "teacher"), torch.device("cpu")
    )
    for update in (1, 2):
        t = trajectory(reference, update)
        for i, row in enumerate(t["prompt_rows"].tolist()):
            record = rows[row]
            text = record["prompt"][0]["content"] + f" (The answer is {record['reward_model']['ground_truth']}.)"
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            own = tokenizer(chat, add_special_tokens=False)["input_ids"]
            n = int(t["response_mask"][i].sum())
            response = t["responses"][i, :n].tolist()
            with torch.no_grad():  # one row, no padding: (1, P' + n)
                logits = teacher(torch.tensor([own + response])).logits[0].float()
            expected = logits[len(own) - 1 : len(own) - 1 + n].log_softmax(-1)[torch.arange(n), response]
            torch.testing.assert_close(t["teacher_logprobs"][i, :n], expected, atol=1e-4, rtol=0)
            assert len(own) > int((t["prompts"][i] != tokenizer.pad_token_id).sum())  # the teacher saw more


def test_without_a_context_the_teacher_scores_the_batch_itself():
    from miniverl.workers.teacher import TeacherWorker

    batch = object()  # nothing is rebuilt, copied or read: the path of every run before contexts existed
    assert TeacherWorker(None, logprob_chunk=1, topk=None).teacher_view(batch) is batch


def test_the_context_is_in_the_report_with_its_digest(reference):
    teacher = json.loads((reference / "report.json").read_text())["models"]["teacher"]
    assert teacher["context"] == {"system": None, "user": "{{ user }}" + HINT, "prompt_limit": None}
    assert len(teacher["context_sha256"]) == 64


@pytest.mark.slow
def test_a_run_stopped_and_resumed_with_a_context_equals_the_whole_run(reference, tmp_path):
    stopped = tmp_path / "stopped"
    assert context_run(stopped, "trainer.stop_after_updates=1")["status"] == "interrupted"
    assert context_run(stopped)["status"] == "measured"
    for name in ("trajectories/update_000001.safetensors", "trajectories/update_000002.safetensors",
                 "peft_adapter/adapter_model.safetensors"):  # fmt: skip
        assert sha256_file(stopped / name) == sha256_file(reference / name)


@pytest.mark.parametrize(
    "extra",
    [
        ["teacher.mode=ref"],
        ["shared_base"],
        ["estimator=forward_kl_topk", "estimator.topk=4"],
        ["estimator=reverse_kl_full"],
    ],
)
@pytest.mark.slow
def test_a_context_works_in_the_ref_and_shared_base_modes_and_with_the_topk_and_full_estimators(
    reference, tmp_path, extra
):
    # ref: on-policy self-distillation, the student's own base teaching itself to do without the hint.
    if extra == ["shared_base"]:  # a teacher adapter on this same toy base (its B = 0: the base's outputs)
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(reference / "toy_models" / "student")
        get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(tmp_path / "adapter")
        extra = ["teacher.mode=shared_base", f"teacher.adapter={tmp_path / 'adapter'}"]
    report = context_run(tmp_path / "run", "recipe.optimizer_updates=1", *extra)
    t = trajectory(tmp_path / "run", 1)
    mask = t["response_mask"].bool()
    # The same weights at update 1 (a fresh LoRA) but another prompt: the log-probs differ.
    assert (t["rollout_log_probs"] - t["teacher_logprobs"])[mask].abs().max() > 1e-2
    assert report["status"] == "measured"


@pytest.mark.parametrize(
    "extra,message",
    [
        (["teacher.context.user='{{ user'"], "teacher.context.user: not a Jinja template"),
        (
            ["teacher.context.user='{{ user }} {{ extra_info.hint }}'"],
            "teacher.context.user: data.train_files row 0: 'dict object' has no attribute 'hint' (the row's fields:",
        ),
        (
            ["teacher.context.prompt_limit=40"],
            "data.train_files row 0: teacher's prompt (with its context) is 75 tokens, over its limit of 40",
        ),
    ],
)
def test_a_bad_template_a_missing_field_or_an_overlong_teacher_prompt_is_one_line(tmp_path, extra, message):
    with pytest.raises(MiniverlError) as error:
        context_run(tmp_path / "run", *extra)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()  # refused before writing anything


def test_the_doctor_renders_every_rows_teacher_prompt():
    cfg = to_config(compose_config(["+recipe=opd_k1_privileged_toy"]))
    check = preflight.guarded("context", preflight.check_context, cfg, models.load_tokenizer("model", cfg.model, None))
    assert check.status == "PASS" and "teacher on data.train_files: " in check.reason
    assert "teacher on data.val_files: " in check.reason


def test_the_export_refuses_a_context_unless_told_to_drop_it(tmp_path):
    with pytest.raises(MiniverlError, match="teacher.context: verl 0.9.1 gives the teacher the student's prompt"):
        export(compose_config(["+recipe=opd_k1_privileged_toy"]), tmp_path / "a", cwd=ROOT)
    result = export(
        compose_config(["+recipe=opd_k1_privileged_toy", "export.drop_teacher_context=true"]), tmp_path / "b", cwd=ROOT
    )
    assert any(w.startswith("teacher.context is dropped") for w in result.warnings)
