"""Checkpoints and exact resume: a run stopped after update k and resumed in a fresh process ends
byte-identical to the uninterrupted run; broken or foreign checkpoints are refused untouched; a
process killed mid-checkpoint leaves the previous checkpoint whole; the PEFT adapter round-trips."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from conftest import ROOT, compose_config, main
from miniverl import checkpoint, models
from miniverl.batch import Batch
from miniverl.errors import MiniverlError
from miniverl.identity import resolved_config, sha256_file
from miniverl.logprobs import response_log_probs
from miniverl.main import run
from miniverl.resume_check import first_difference
from miniverl.schema import to_config
from miniverl.trainer import OPDTrainer

N = 4
ARGS = ["+recipe=opd_k1", "model=toy", "teacher=toy", f"recipe.optimizer_updates={N}",
        "recipe.interrupt_after_updates=null", "recipe.response_limit=12", "actor.optim.lr=1e-3",
        "trainer.progress_bar=false"]


def run_in_process(run_dir, *extra):
    cfg = compose_config([*ARGS, *extra])
    return run(cfg, run_dir)


def tree_digest(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    report = run_in_process(run_dir)
    assert report["status"] == "completed"
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, N - 1])
def test_stopped_after_k_and_resumed_in_a_fresh_process_equals_the_uninterrupted_run(reference, tmp_path, k):
    stopped = tmp_path / "stopped"
    report = run_in_process(stopped, f"trainer.stop_after_updates={k}")
    assert report["status"] == "interrupted" and [p.name for p in checkpoint.checkpoints_in(stopped)][-1] == f"update_{k}"
    resumed = tmp_path / "resumed"
    result = main(*ARGS, f"trainer.resume_from={stopped}", f"hydra.run.dir={resumed}")
    assert result.returncode == 0, result.stderr
    verdicts, difference = first_difference(reference, resumed)
    assert difference is None, difference
    assert verdicts["adapter_and_optimizer_byte_identical"] and verdicts["trajectories_byte_identical"]
    ref_report = json.loads((reference / "report.json").read_text())
    res_report = json.loads((resumed / "report.json").read_text())
    assert res_report["artifacts"]["trajectory_sha256"] == ref_report["artifacts"]["trajectory_sha256"]
    assert res_report["artifacts"]["standard_peft_adapter_sha256"] == ref_report["artifacts"]["standard_peft_adapter_sha256"]
    assert res_report["recipe"]["compiled_plan_sha256"] == ref_report["recipe"]["compiled_plan_sha256"]
    assert len((resumed / "metrics.jsonl").read_text().splitlines()) == N


def test_resume_mode_auto_continues_a_stopped_run_in_its_own_folder(reference, tmp_path):
    folder = tmp_path / "run"
    run_in_process(folder, "trainer.stop_after_updates=2")
    report = run_in_process(folder)  # same hydra.run.dir, trainer.resume_mode=auto (the default)
    assert report["status"] == "completed" and report["resume"]["status"] == "resumed"
    assert first_difference(reference, folder)[1] is None


def test_resume_mode_disable_refuses_a_folder_that_holds_a_run(tmp_path):
    folder = tmp_path / "run"
    run_in_process(folder, "trainer.stop_after_updates=2")
    with pytest.raises(MiniverlError, match="already holds a run"):
        run_in_process(folder, "trainer.resume_mode=disable")


@pytest.fixture
def stopped_run(tmp_path):
    folder = tmp_path / "stopped"
    run_in_process(folder, "trainer.stop_after_updates=2")
    return folder


@pytest.mark.parametrize("damage,message", [
    (lambda ckpt: (ckpt / "optimizer.safetensors").unlink(), "is incomplete: missing optimizer.safetensors"),
    (lambda ckpt: (ckpt / "adapter.safetensors").write_bytes(
        (ckpt / "adapter.safetensors").read_bytes()[:-1] + b"\x00"), "adapter.safetensors does not match its sha256"),
    (lambda ckpt: None, "belongs to another plan"),
])
def test_a_broken_or_foreign_checkpoint_is_refused_without_touching_any_file(stopped_run, tmp_path, damage, message):
    damage(checkpoint.checkpoints_in(stopped_run)[-1])
    before = tree_digest(stopped_run)
    extra = ["recipe.logical_batch=2"] if message == "belongs to another plan" else []
    target = tmp_path / "new"
    with pytest.raises(MiniverlError, match=message) as info:
        run_in_process(target, f"trainer.resume_from={stopped_run}", *extra)
    assert "\n" not in str(info.value)
    assert tree_digest(stopped_run) == before
    assert not target.exists()


def test_the_refusal_is_one_line_on_the_command_line(stopped_run, tmp_path):
    (checkpoint.checkpoints_in(stopped_run)[-1] / "state.json").unlink()
    result = main(*ARGS, f"trainer.resume_from={checkpoint.checkpoints_in(stopped_run)[-1]}",
                  f"hydra.run.dir={tmp_path / 'new'}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("miniverl: error: trainer.resume_from")


KILL_SCRIPT = """
import sys, time
from pathlib import Path
sys.path[:0] = [{root!r}, {tests!r}]
from miniverl import checkpoint
real_fsync_dir = checkpoint._fsync_dir
def slow_fsync_dir(path):
    if path.name == ".update_3.tmp":  # files written, folder not yet renamed into place
        Path({signal!r}).write_text("writing")
        time.sleep(120)
    real_fsync_dir(path)
checkpoint._fsync_dir = slow_fsync_dir
from test_resume import run_in_process
run_in_process(Path({run_dir!r}))
"""


def test_a_process_killed_while_writing_a_checkpoint_leaves_the_previous_one_loadable(reference, tmp_path):
    run_dir, flag = tmp_path / "killed", tmp_path / "writing"
    script = KILL_SCRIPT.format(root=str(ROOT), tests=str(ROOT / "tests"), signal=str(flag), run_dir=str(run_dir))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while not flag.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert flag.exists(), child.stderr.read().decode()[-2000:]
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert [p.name for p in checkpoint.checkpoints_in(run_dir)] == ["update_1", "update_2"]
    assert (run_dir / "checkpoints" / ".update_3.tmp").is_dir()  # the torn write, invisible
    report = run_in_process(run_dir)  # auto-resume from update_2, in the same folder
    assert report["resume"]["resumed_from"].endswith("update_2")
    assert first_difference(reference, run_dir)[1] is None


def test_the_peft_adapter_reproduces_the_trained_students_log_probs(tmp_path):
    cfg = compose_config([*ARGS, "recipe.optimizer_updates=2"])
    trainer = OPDTrainer(to_config(cfg), resolved_config(cfg), tmp_path / "run")
    trainer.setup()
    trainer.train()
    report = trainer.finish()
    adapter_dir = tmp_path / "run" / "peft_adapter"
    assert report["artifacts"]["standard_peft_adapter_sha256"] == sha256_file(adapter_dir / "adapter_model.safetensors")
    block = trainer.cfg.model
    base = models.load_causal_lm("model", block, models.source_of(block, tmp_path / "run" / "toy_models" / "student"),
                                 torch.device("cpu"))
    loaded = PeftModel.from_pretrained(base, adapter_dir).eval()
    t = load_file(str(tmp_path / "run" / "trajectories" / "update_000002.safetensors"))
    batch = Batch(**{k: v for k, v in t.items() if k in Batch.__dataclass_fields__})
    with torch.no_grad():
        trainer.student.eval()
        ours = response_log_probs(trainer.student.get_base_model(), batch)
        theirs = response_log_probs(loaded.get_base_model(), batch)
    torch.testing.assert_close(theirs, ours, rtol=1e-6, atol=1e-6)
    assert not torch.equal(ours, torch.as_tensor(t["old_log_probs"]))  # the adapter moved since that rollout


def test_only_the_newest_checkpoints_are_kept_when_asked_and_resume_still_works(reference, tmp_path):
    folder = tmp_path / "run"
    run_in_process(folder, "trainer.stop_after_updates=3", "trainer.max_actor_ckpt_to_keep=2")
    assert [p.name for p in checkpoint.checkpoints_in(folder)] == ["update_2", "update_3"]
    report = run_in_process(folder, "trainer.max_actor_ckpt_to_keep=2")  # auto-resume from update_3
    assert report["resume"]["resumed_from"].endswith("update_3")
    assert [p.name for p in checkpoint.checkpoints_in(folder)] == ["update_3", "update_4"]
    assert first_difference(reference, folder)[1] is None
