"""Checkpoints and exact resume: a run stopped after update k and resumed in a fresh process ends
byte-identical to the uninterrupted run; broken or foreign checkpoints are refused untouched; a
process killed mid-checkpoint leaves the previous checkpoint whole; the PEFT adapter round-trips."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from miniverl.config import to_config
from miniverl.models import loading as models
from miniverl.protocol import Batch
from miniverl.trainer import resume_check
from miniverl.trainer.opd_trainer import OPDTrainer
from miniverl.trainer.resume_check import first_difference
from miniverl.trainer.runner import run, same_command
from miniverl.utils import checkpoint, device
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import resolved_config, sha256_file
from miniverl.utils.run_folder import RunFolder
from miniverl.utils.run_names import MACHINE_METRIC_PREFIXES
from miniverl.workers.logprobs import response_log_probs
from miniverl.workers.rollout import RolloutWorker

from conftest import ROOT, compose_config, main, run_as_command

N = 4
ARGS = [
    "+recipe=opd_k1",
    "model=toy",
    "teacher=toy",
    f"recipe.optimizer_updates={N}",
    "recipe.interrupt_after_updates=null",
    "recipe.response_limit=12",
    "actor.optim.lr=1e-3",
    "trainer.progress_bar=false",
]


def run_in_process(run_dir, *extra):
    cfg = compose_config([*ARGS, *extra])
    return run(cfg, run_dir)


def tree_digest(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    report = run_in_process(run_dir)
    assert report["status"] == "measured"
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("k", [1])
def test_stopped_after_k_and_resumed_in_a_fresh_process_equals_the_uninterrupted_run(reference, tmp_path, k, capsys):
    stopped = tmp_path / "stopped"
    report = run_in_process(stopped, f"trainer.stop_after_updates={k}")
    assert (
        report["status"] == "interrupted" and [p.name for p in checkpoint.checkpoints_in(stopped)][-1] == f"update_{k}"
    )
    # It says how to resume, as a Ctrl-C does: the same command (stop_after_updates included) + resume_from.
    said = capsys.readouterr().out.strip().splitlines()[-1]
    assert said == (
        f"miniverl: stopped by trainer.stop_after_updates after update {k}, nothing left half-done; the last "
        f"complete checkpoint is {stopped / 'checkpoints' / f'update_{k}'}; resume with the same command and "
        f"trainer.resume_from={stopped}"
    )
    resumed = tmp_path / "resumed"
    same = [*ARGS, f"trainer.stop_after_updates={k}"]
    result = main(*same, f"trainer.resume_from={stopped}", f"hydra.run.dir={resumed}")
    assert result.returncode == 0, result.stderr
    verdicts, difference = first_difference(reference, resumed)
    assert difference is None, difference
    assert verdicts["adapter_and_optimizer_byte_identical"] and verdicts["trajectories_byte_identical"]
    ref_report = json.loads((reference / "report.json").read_text())
    res_report = json.loads((resumed / "report.json").read_text())
    assert res_report["artifacts"]["trajectory_sha256"] == ref_report["artifacts"]["trajectory_sha256"]
    assert (
        res_report["artifacts"]["standard_peft_adapter_sha256"]
        == ref_report["artifacts"]["standard_peft_adapter_sha256"]
    )
    assert res_report["recipe"]["compiled_plan_sha256"] == ref_report["recipe"]["compiled_plan_sha256"]
    assert len((resumed / "metrics.jsonl").read_text().splitlines()) == N
    # Its steady state is its own: the updates after its first (k + 1 paid its warm-up), not the stopped run's.
    gen = [json.loads(line)["timing_s/gen"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    own = res_report["measurements"]["steady_state_median_seconds"]["rollout"]
    assert own == round(statistics.median(gen[k + 1 :]), 4)


@pytest.mark.slow
def test_a_student_with_dropout_resumes_exactly(tmp_path):
    """Dropout's masks come from torch's global generators, which no checkpoint holds: seeded per update
    from trainer.seed, a resumed run draws the uninterrupted run's (a CUDA review showed the recipe's
    resume check failing with model.lora.dropout=0.1). In one process, so the generators have moved on
    between the runs as they would not in a fresh one."""
    dropout = "model.lora.dropout=0.1"
    whole = run_in_process(tmp_path / "whole", dropout)
    run_in_process(tmp_path / "stopped", dropout, "trainer.stop_after_updates=2")
    torch.rand(7)  # the global generator elsewhere than where the stop left it
    resumed = run_in_process(tmp_path / "resumed", dropout, f"trainer.resume_from={tmp_path / 'stopped'}")
    assert resumed["resume"]["resumed_after_update"] == 2
    for key in ("trajectory_sha256", "standard_peft_adapter_sha256"):
        assert resumed["artifacts"][key] == whole["artifacts"][key], key
    without = run_in_process(tmp_path / "without")  # the dropout is at work: other weights without it
    assert without["artifacts"]["standard_peft_adapter_sha256"] != whole["artifacts"]["standard_peft_adapter_sha256"]


def test_a_resumed_run_goes_on_at_the_sizes_an_out_of_memory_error_halved(tmp_path, monkeypatch):
    """A transient out-of-memory error halves the rollout's rows for the rest of the run; a run
    resumed after it must go on at the halved size, as the uninterrupted run does: in half
    precision, products of other row counts round differently and can sample other tokens."""
    real_rollout = RolloutWorker.generate_sequences
    failures_left, rows_seen = [0], []

    def rollout(self, *args, physical_batches, **kwargs):
        rows_seen.extend(physical_batches)
        if failures_left[0] and max(physical_batches) > 2:
            failures_left[0] -= 1
            raise torch.OutOfMemoryError("transient, injected by the test")
        return real_rollout(self, *args, physical_batches=physical_batches, **kwargs)

    monkeypatch.setattr(RolloutWorker, "generate_sequences", rollout)
    failures_left[0] = 1
    reference = tmp_path / "reference"
    assert run_in_process(reference)["measurements"]["batch_downshifts"]["rollout_oom"] == 1
    failures_left[0] = 1
    stopped = tmp_path / "stopped"
    assert run_in_process(stopped, "trainer.stop_after_updates=1")["status"] == "interrupted"
    rows_seen.clear()  # the resumed run meets no out-of-memory error: memory was only short before
    resumed = tmp_path / "resumed"
    report = run_in_process(resumed, "trainer.stop_after_updates=1", f"trainer.resume_from={stopped}")
    assert set(rows_seen) == {2}  # the size the run had halved to, not the configured 4
    verdicts, difference = first_difference(reference, resumed)
    assert difference is None, difference  # the state's `downshift` included
    assert report["measurements"]["batch_downshifts"] == {"rollout_oom": 1, "update_chunk_oom": 0}
    assert report["measurements"]["observed_rollout_physical_batch_sizes"] == [2]


@pytest.mark.slow
def test_a_resumed_run_goes_on_at_the_sizes_the_held_out_probe_halved_its_own_rows_to(tmp_path, monkeypatch):
    """The probe's downshift is its own, and checkpoints keep it apart from training's: a transient
    out-of-memory error in the probe's 4-row rollouts halves them to 2 for the rest of the run, a
    resumed run's included, while training goes on at its 4 rows."""
    real_rollout = RolloutWorker.generate_sequences
    failures_left, probe_rows, training_rows = [0], [], []

    def rollout(self, prompts, *args, physical_batches, **kwargs):
        (probe_rows if len(prompts) == 16 else training_rows).extend(physical_batches)  # 16 held-out prompts
        if failures_left[0] and len(prompts) == 16 and max(physical_batches) > 2:
            failures_left[0] -= 1
            raise torch.OutOfMemoryError("transient, injected by the test")
        return real_rollout(self, prompts, *args, physical_batches=physical_batches, **kwargs)

    monkeypatch.setattr(RolloutWorker, "generate_sequences", rollout)
    heldout = ["data.val_files=data/toy_prompts_heldout.parquet", "eval.every=1"]
    failures_left[0] = 1
    stopped = tmp_path / "stopped"
    assert run_in_process(stopped, *heldout, "trainer.stop_after_updates=1")["status"] == "interrupted"
    state = json.loads((checkpoint.checkpoints_in(stopped)[-1] / "state.json").read_text())
    assert state["eval_downshift"]["rows"]["rollout"] == 2 and state["downshift"]["rows"]["rollout"] == 4
    probe_rows.clear(), training_rows.clear()  # the resumed run meets no error: memory was only short before
    report = run_in_process(tmp_path / "resumed", *heldout, f"trainer.resume_from={stopped}")
    assert set(probe_rows) == {2} and set(training_rows) == {4}
    assert report["measurements"]["batch_downshifts"] == {"rollout_oom": 1, "update_chunk_oom": 0}


def test_a_failed_updates_halving_is_not_kept_by_the_checkpoint_of_the_update_before(tmp_path, monkeypatch):
    """Out of memory at one row in update 2: the run fails and checkpoints update 1, with the sizes
    update 1 ran at, so a resume on a device with more memory goes on at them, not at one row."""
    real_rollout = RolloutWorker.generate_sequences

    def rollout(self, *args, physical_batches, **kwargs):
        if rollout.calls >= 1:  # every rollout after the first: out of memory at any size
            raise torch.OutOfMemoryError("injected by the test")
        rollout.calls += 1
        return real_rollout(self, *args, physical_batches=physical_batches, **kwargs)

    rollout.calls = 0
    monkeypatch.setattr(RolloutWorker, "generate_sequences", rollout)
    with pytest.raises(MiniverlError, match="update 2 failed: out of memory in a rollout of a single row"):
        run_in_process(tmp_path / "run", "trainer.save_freq=-1")  # update 1 is saved only after the failure
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "failed" and report["measurements"]["batch_downshifts"]["rollout_oom"] == 2
    state = json.loads((checkpoint.checkpoints_in(tmp_path / "run")[-1] / "state.json").read_text())
    assert state["global_optimizer_steps"] == 1
    assert state["downshift"]["rows"] == {"rollout": 4, "update_chunk": 4}
    assert state["downshift"]["batch_downshifts"] == {"rollout_oom": 0, "update_chunk_oom": 0}


HELD_OUT = ["data.val_files=data/toy_prompts_heldout.parquet", "eval.every=2"]  # probes after 0, 2 and 4 updates


@pytest.fixture(scope="module")
def probed_reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("probed") / "run"
    assert run_in_process(run_dir, *HELD_OUT, "trainer.max_actor_ckpt_to_keep=null")["status"] == "measured"
    return run_dir


def without_timings(metrics_file):
    lines = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.startswith(MACHINE_METRIC_PREFIXES)} for m in lines]


@pytest.mark.slow
@pytest.mark.parametrize(
    "failed_after,save_freq,into",
    [(2, 1, "its folder"), (2, -1, "its folder"), (N, 1, "its folder"), (N, -1, "another")],
)
def test_a_probe_out_of_memory_after_an_update_is_measured_by_the_resume_which_ends_as_the_uninterrupted_run(
    probed_reference, tmp_path, monkeypatch, failed_after, save_freq, into
):
    """The held-out probe runs out of memory at one row after update u (2, or the final one), whose
    optimizer step and trajectory are done: the run checkpoints update u under its own number, not
    finished, whatever trainer.save_freq (before: update u's weights under u-1's number with
    save_freq -1; a final checkpoint marked finished, which no resume would take). The resume
    measures the probe it owes first, at the sizes the last probe that succeeded used, and ends byte
    for byte as the uninterrupted run, held-out points and metrics.jsonl included. Where update u's
    checkpoint is due, the resume saves it again with the probe's point: in its own folder only its
    state.json is replaced (atomically; the tensor files stay in place), in another as a new one."""
    real_rollout = RolloutWorker.generate_sequences
    probes = []

    def rollout(self, prompts, *args, physical_batches, **kwargs):
        if len(prompts) == 16:  # the 16 held-out prompts
            probes.append(physical_batches)
            if len(probes) > failed_after // 2:  # the probe after update `failed_after`, at every size it halves to
                raise torch.OutOfMemoryError("injected by the test")
        return real_rollout(self, prompts, *args, physical_batches=physical_batches, **kwargs)

    folder = tmp_path / "run"
    settings = [*HELD_OUT, f"trainer.save_freq={save_freq}", "trainer.max_actor_ckpt_to_keep=null"]
    with monkeypatch.context() as patch:
        patch.setattr(RolloutWorker, "generate_sequences", rollout)
        match = f"update {failed_after} failed: held-out probe after update {failed_after}: out of memory"
        with pytest.raises(MiniverlError, match=match):
            run_in_process(folder, *settings)
    saved = checkpoint.checkpoints_in(folder)[-1]
    state = json.loads((saved / "state.json").read_text())
    assert checkpoint.checkpoint_update(saved) == state["global_optimizer_steps"] == failed_after
    assert len(state["history"]) == len(state["trajectory_digests"]) == failed_after and not state["finished"]
    assert [p["update"] for p in state["distillation_progress"]["exact_reverse_kl"]] == list(range(0, failed_after, 2))
    assert state["eval_downshift"]["rows"]["rollout"] == 4  # the failed probe's halvings to 2 and 1 are not kept
    same_update = probed_reference / "checkpoints" / f"update_{failed_after}"
    files = sorted(p.name for p in saved.iterdir() if p.name != "state.json")
    assert files and files == sorted(p.name for p in same_update.iterdir() if p.name != "state.json")
    assert all((saved / name).read_bytes() == (same_update / name).read_bytes() for name in files)

    inode = (saved / "adapter.safetensors").stat().st_ino

    resumed = folder if into == "its folder" else tmp_path / "resumed"
    if resumed != folder:  # the owed probe fails again in the new folder, which then holds update u's checkpoint
        with monkeypatch.context() as patch:
            patch.setattr(RolloutWorker, "generate_sequences", rollout)
            with pytest.raises(MiniverlError, match=f"resume with trainer.resume_from={resumed}"):
                run_in_process(resumed, *settings, f"trainer.resume_from={folder}")
        assert [checkpoint.checkpoint_update(c) for c in checkpoint.checkpoints_in(resumed)] == [failed_after]
    report = run_in_process(resumed, *settings)  # the probe's sizes as before: its halvings did not help
    assert report["status"] == "measured" and report["resume"]["resumed_after_update"] == failed_after
    assert report["resume"]["resumed_from"] == str(resumed / "checkpoints" / f"update_{failed_after}")
    assert first_difference(probed_reference, resumed)[1] is None
    expected = json.loads((probed_reference / "report.json").read_text())["distillation_progress"]
    assert report["distillation_progress"] == expected and len(expected["exact_reverse_kl"]) == 3
    assert without_timings(resumed / "metrics.jsonl") == without_timings(probed_reference / "metrics.jsonl")
    if checkpoint.is_due(failed_after, to_config(compose_config([*ARGS, *settings])).trainer, N):
        again = resumed / "checkpoints" / f"update_{failed_after}"
        state = json.loads((again / "state.json").read_text())
        assert state["distillation_progress"]["exact_reverse_kl"][-1]["update"] == failed_after
        assert any(key.startswith("val/") for key in state["history"][-1])
        assert state["finished"] == (failed_after == N)
        assert resumed != folder or (again / "adapter.safetensors").stat().st_ino == inode


@pytest.mark.slow
def test_a_damaged_checkpoint_is_replaced_whole_when_a_resume_from_the_one_before_saves_its_update_again(tmp_path):
    """The refusal of a damaged checkpoint says to resume from an earlier one: that resume saves the
    damaged update again with the same bytes, which replace the damaged files (a re-save of unchanged
    tensors replaces only state.json, so the files on disk are hashed, not their recorded sha256)."""
    folder = tmp_path / "run"
    run_in_process(folder, "trainer.stop_after_updates=2")
    damaged = folder / "checkpoints" / "update_2" / "adapter.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-1] + bytes([damaged.read_bytes()[-1] ^ 1]))
    with pytest.raises(MiniverlError, match="does not match its sha256") as refused:
        run_in_process(folder)
    earlier = folder / "checkpoints" / "update_1"
    assert str(refused.value).endswith(f"(corrupted); resume from an earlier checkpoint: trainer.resume_from={earlier}")
    run_in_process(folder, f"trainer.resume_from={earlier}", "trainer.stop_after_updates=3")  # as the line says
    state = json.loads((folder / "checkpoints" / "update_2" / "state.json").read_text())
    assert sha256_file(damaged) == state["files"]["adapter.safetensors"]


@pytest.mark.slow
def test_resume_mode_auto_continues_a_stopped_run_in_its_own_folder(reference, tmp_path):
    folder = tmp_path / "run"
    run_in_process(folder, "trainer.stop_after_updates=2")
    report = run_in_process(folder)  # same hydra.run.dir, trainer.resume_mode=auto (the default)
    assert report["status"] == "measured" and report["resume"]["status"] == "resumed"
    assert report["resume"]["resumed_from"] == str(folder / "checkpoints" / "update_2")
    assert report["resume"]["resumed_after_update"] == 2
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


@pytest.mark.slow
def test_an_altered_trajectory_names_the_checkpoint_before_it_or_says_to_start_anew(stopped_run, tmp_path):
    """A new-user audit flipped a byte of a stopped run's trajectory: "missing or altered", and no way on."""
    kept = checkpoint.checkpoints_in(stopped_run)
    for update in (1, 2):
        source = stopped_run / "trajectories" / f"update_{update:06d}.safetensors"
        intact = source.read_bytes()
        source.write_bytes(intact[:-1] + bytes([intact[-1] ^ 1]))
        with pytest.raises(MiniverlError, match=f"trajectory {source} is missing or altered") as info:
            run_in_process(tmp_path / f"new{update}", f"trainer.resume_from={stopped_run}")
        before = [c for c in kept if checkpoint.checkpoint_update(c) < update]
        way = f"trainer.resume_from={before[-1]})" if before else "start the run anew (another hydra.run.dir"
        assert way in str(info.value)
        source.write_bytes(intact)
    assert [checkpoint.checkpoint_update(c) for c in kept] == [1, 2]  # both ways were taken


def test_a_stop_before_the_update_a_run_resumes_from_is_said_not_silently_ignored(stopped_run, tmp_path, caplog):
    """The stop's own command (stop_after_updates=2) resumes the run to its end by design; an earlier
    stop cannot apply to a run past it: the log says so."""
    report = run_in_process(tmp_path / "on", f"trainer.resume_from={stopped_run}", "trainer.stop_after_updates=1")
    assert report["status"] == "measured"
    assert "trainer.stop_after_updates=1 is before update 2, where this run resumes: no stop" in caplog.text
    caplog.clear()
    run_in_process(tmp_path / "same", f"trainer.resume_from={stopped_run}", "trainer.stop_after_updates=2")
    assert "trainer.stop_after_updates" not in caplog.text


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda ckpt: (ckpt / "optimizer.safetensors").unlink(), "is incomplete: missing optimizer.safetensors"),
        (
            lambda ckpt: (ckpt / "adapter.safetensors").write_bytes(
                (ckpt / "adapter.safetensors").read_bytes()[:-1] + b"\x00"
            ),
            "adapter.safetensors does not match its sha256",
        ),
        (lambda ckpt: None, "belongs to another plan"),
    ],
)
@pytest.mark.slow
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


@pytest.mark.slow
def test_a_checkpoint_of_other_settings_is_refused_with_the_overrides_that_resume_it(stopped_run, tmp_path, reference):
    """A recipe that changed between versions (or a changed override): the refusal lists the
    settings of the stopped run where they differ, and with them the resume goes on exactly."""
    with pytest.raises(MiniverlError) as info:
        run_in_process(tmp_path / "new", f"trainer.resume_from={stopped_run}", "recipe.logical_batch=2")
    message = str(info.value)
    assert "belongs to another plan" in message and ": resume with recipe.logical_batch=4, or for a new run" in message
    assert message.endswith(", or for a new run drop trainer.resume_from")
    report = run_in_process(tmp_path / "again", f"trainer.resume_from={stopped_run}", "recipe.logical_batch=4")
    assert report["resume"]["status"] == "resumed" and first_difference(reference, tmp_path / "again")[1] is None


def test_a_checkpoint_whose_plan_orders_the_prompts_otherwise_says_so_not_to_resume_with_its_overrides(
    stopped_run, tmp_path
):
    """A review: a run stopped under an earlier miniverl with data.shuffle=true planned another order (before
    verl's dataloader's); its resume was refused "resume with the overrides of the run that wrote it", which it
    had done. Simulated: the stopped run's plan.json with each update's prompts reversed, its checkpoint's
    plan digest that plan's."""
    from miniverl.utils.identity import sha256_json

    plan = json.loads((stopped_run / "plan.json").read_text())
    for update in plan["updates"]:
        update["prompt_rows"] = update["prompt_rows"][::-1]
    (stopped_run / "plan.json").write_text(json.dumps(plan))
    last = checkpoint.checkpoints_in(stopped_run)[-1] / "state.json"
    state = json.loads(last.read_text())
    state["compiled_plan_sha256"] = sha256_json(plan)
    last.write_text(json.dumps(state))
    with pytest.raises(MiniverlError) as info:
        run_in_process(tmp_path / "new", f"trainer.resume_from={stopped_run}")
    assert "its plan takes the prompts in another order, an earlier miniverl's" in str(info.value)
    assert "resume with the overrides" not in str(info.value)


def test_a_resume_in_a_process_that_computes_otherwise_is_refused_or_with_resume_inexact_goes_on_said_so(
    stopped_run, tmp_path
):
    """Another torch thread count splits the CPU's sums otherwise: the resumed run would part from the
    stopped one within an update or two. The checkpoint records the kernel environment; a resume under
    another is refused in one line saying how to match it, untouched, unless trainer.resume_inexact."""
    state = json.loads((checkpoint.checkpoints_in(stopped_run)[-1] / "state.json").read_text())
    threads = torch.get_num_threads()
    assert state["numerics_environment"]["torch_threads"] == threads
    before = tree_digest(stopped_run)
    torch.set_num_threads(threads + 1)
    try:
        with pytest.raises(MiniverlError) as info:
            run_in_process(tmp_path / "new", f"trainer.resume_from={stopped_run}")
        stopped = run_in_process(
            tmp_path / "inexact",
            f"trainer.resume_from={stopped_run}",
            "trainer.resume_inexact=true",
            "trainer.stop_after_updates=3",
        )
        report = run_in_process(tmp_path / "inexact")  # its own checkpoint, in the same process: exact from there
    finally:
        torch.set_num_threads(threads)
    message = str(info.value)
    assert f"(torch_threads {threads} -> {threads + 1})" in message and "\n" not in message
    assert f"resume with OMP_NUM_THREADS={threads}, or add trainer.resume_inexact=true" in message
    assert tree_digest(stopped_run) == before and not (tmp_path / "new").exists()
    assert stopped["resume"]["resumed_after_update"] == 2
    assert report["status"] == "measured" and report["resume"]["resumed_after_update"] == 3
    # An audit: the exact second resume reported none, though the run's updates 3 and 4 were computed otherwise.
    assert (
        stopped["resume"]["inexact_because"]
        == report["resume"]["inexact_because"]
        == [f"torch_threads {threads} -> {threads + 1}"]
    )


def test_a_resume_under_an_isa_cap_is_refused_for_its_kernels_before_its_plan(stopped_run, tmp_path, monkeypatch):
    """A oneDNN cap changes the CPU's products, and so the plan's CPU-resolved settings: the line names
    the cap, the cause, rather than the settings it changed (which, pinned, would resume inexactly)."""
    was = device.onednn_isa_cap()  # the suite may itself run under a cap (docs/testing.md)
    cap = "SSE41" if was == "AVX2" else "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    device.cpu_bf16_instructions.cache_clear()
    try:
        with pytest.raises(MiniverlError, match="written by a process that computes otherwise") as info:
            run_in_process(tmp_path / "new", f"trainer.resume_from={stopped_run}")
    finally:
        device.cpu_bf16_instructions.cache_clear()
    undo = f"with ONEDNN_MAX_CPU_ISA={was}" if was else "without ONEDNN_MAX_CPU_ISA"
    assert f"onednn_max_cpu_isa {was} -> {cap}" in str(info.value) and f"resume {undo}" in str(info.value)


def test_a_sweep_jobs_own_command_carries_the_thread_count_its_launcher_set(monkeypatch):
    """joblib's workers run cores / n_jobs threads (OMP_NUM_THREADS in their environment): the job's own
    command, run alone from a shell, must say so, or its resume would be refused as another process."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    assert (
        same_command(["estimator=k3"], sweep=True) == f"OMP_NUM_THREADS={threads} python -m miniverl.main estimator=k3"
    )
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert same_command(["estimator=k3"], sweep=True) == "python -m miniverl.main estimator=k3"
    assert same_command(["estimator=k3"], sweep=False) == "the same command"


@pytest.mark.slow
def test_overwrite_empties_the_run_folder_and_still_resumes_from_another_one(stopped_run, tmp_path, reference):
    folder = tmp_path / "old"
    run_in_process(folder, "trainer.stop_after_updates=1")  # a run of its own, to be replaced
    report = run_in_process(folder, "trainer.overwrite=true", f"trainer.resume_from={stopped_run}")
    assert report["resume"]["status"] == "resumed" and report["resume"]["resumed_after_update"] == 2
    assert first_difference(reference, folder)[1] is None


def test_overwrite_refuses_to_resume_from_the_folder_it_would_empty(stopped_run):
    before = tree_digest(stopped_run)
    with pytest.raises(MiniverlError, match="is in the run folder that trainer.overwrite=true would empty") as info:
        run_in_process(stopped_run, "trainer.overwrite=true", f"trainer.resume_from={stopped_run}")
    assert "\n" not in str(info.value) and tree_digest(stopped_run) == before


@pytest.mark.slow
def test_the_resume_checks_twins_get_the_commands_config_and_overrides_leave_out_the_probe_and_still_match(tmp_path):
    """The command's config flags reach the twins: a user's own recipe, found through
    --config-dir, composes in theirs too (Hydra keeps the flag out of the task's overrides, and the
    twins once failed to find the recipe). trainer.overwrite=true reaches them with the other
    overrides: the resumed twin must resume (it once started afresh, checked its own resume, and
    so on without end). The probe measures and never trains: the twins skip it (a third of their
    time on the real recipe) and still match. Its out-of-memory halvings are its own: here its 8-row
    rollouts fail (training's 4-row ones fit), and training's sizes, which the checkpoints keep,
    stay untouched."""
    conf = tmp_path / "my_conf"
    (conf / "recipe").mkdir(parents=True)
    (conf / "recipe" / "my_recipe.yaml").write_text(  # ARGS' settings and a held-out probe at every update
        "# @package _global_\ndefaults:\n  - /recipe/opd_k1\n  - _self_\n"
        f"recipe:\n  optimizer_updates: {N}\n  response_limit: 12\n  interrupt_after_updates: 2\n"
        "actor:\n  optim:\n    lr: 1.0e-3\n"
        "data:\n  val_files: data/toy_prompts_heldout.parquet\neval:\n  every: 1\n"
    )
    oom = ["hardware.rollout_physical_batch=8", "hardware.simulate_oom_above_rows=4"]
    args = ["+recipe=my_recipe", "model=toy", "teacher=toy", "trainer.progress_bar=false", *oom]
    folder = tmp_path / "run"
    run_in_process(folder)  # the folder holds a finished run, which overwrite replaces
    code = run_as_command("main", f"--config-dir={conf}", *args, "trainer.overwrite=true", f"hydra.run.dir={folder}")
    report = json.loads((folder / "report.json").read_text())
    assert code == 0 and report["resume"]["status"] == "exact_match", report["resume"]
    assert report["resume"]["resumed_after_update"] == 2
    assert not (folder / "resume_check" / "resumed" / "resume_check").exists()  # no twin checked its own
    assert report["measurements"]["batch_downshifts"] == {"rollout_oom": 1, "update_chunk_oom": 0}  # the probe's

    def last_state(run_dir):
        return json.loads((checkpoint.checkpoints_in(run_dir)[-1] / "state.json").read_text())

    def held_out_keys(run_dir):
        return {k for metrics in last_state(run_dir)["history"] for k in metrics if k.startswith("val/")}

    training_shift = last_state(folder)["downshift"]
    assert training_shift["rows"] == {"rollout": 8, "update_chunk": 4}  # not the probe's halved 4
    assert training_shift["batch_downshifts"] == {"rollout_oom": 0, "update_chunk_oom": 0}
    assert "val/distillation/k1_mean" in held_out_keys(folder)  # the reference measured at every update
    for twin in ("interrupted", "resumed"):
        assert held_out_keys(folder / "resume_check" / twin) == set()


def test_a_sweep_job_run_again_keeps_its_sound_finished_run_and_fails_again_on_a_mismatch(reference, tmp_path):
    """The same sweep in its folder: a finished job is not trained again, and one whose resume check
    found a difference says so again, not that its folder holds a run."""
    import shutil

    folder = tmp_path / "job"
    shutil.copytree(reference, folder)
    before = tree_digest(folder)
    report = run(compose_config([*ARGS, "trainer.progress_bar=true"]), folder, ARGS, sweep=True)  # run control aside
    assert report["status"] == "measured" and tree_digest(folder) == before
    with pytest.raises(MiniverlError, match="already holds a"):  # outside a sweep: refused as before
        run(compose_config(ARGS), folder, ARGS)
    mismatch = json.loads((folder / "report.json").read_text())
    mismatch["resume"] = {"status": "mismatch", "first_difference": "trajectories/update_000002.safetensors differs"}
    (folder / "report.json").write_text(json.dumps(mismatch))
    with pytest.raises(MiniverlError, match=r"^resume check failed: trajectories/update_000002.safetensors differs"):
        run(compose_config(ARGS), folder, ARGS, sweep=True)


def test_a_twin_of_the_resume_check_never_checks_its_own_resume(tmp_path, monkeypatch):
    monkeypatch.setenv(resume_check.TWIN_ENV, "1")
    report = run_in_process(tmp_path / "twin", "recipe.interrupt_after_updates=2")
    assert report["status"] == "measured" and report["resume"]["status"] == "not_checked"


def test_the_refusal_is_one_line_from_the_command(stopped_run, tmp_path, capfd):
    (checkpoint.checkpoints_in(stopped_run)[-1] / "state.json").unlink()
    source = checkpoint.checkpoints_in(stopped_run)[-1]
    assert run_as_command("main", *ARGS, f"trainer.resume_from={source}", f"hydra.run.dir={tmp_path / 'new'}") == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("miniverl: error: trainer.resume_from")


HERE = Path(__file__).parent  # this module, imported by the child processes below
KILL_SCRIPT = """
import sys, time
from pathlib import Path
sys.path[:0] = [{root!r}, {root!r} + "/tests", {tests!r}]  # conftest, and this test module
from miniverl.utils import checkpoint
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


def sigkill_once_flagged(script: str, flag: Path) -> None:
    """Run `script` in a fresh process and SIGKILL it (as a preemption would: no handler runs)
    as soon as it creates `flag`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while not flag.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert flag.exists(), child.stderr.read().decode()[-2000:]
    child.send_signal(signal.SIGKILL)
    child.wait()


@pytest.mark.slow
def test_a_process_killed_while_writing_a_checkpoint_leaves_the_previous_one_loadable(reference, tmp_path, caplog):
    run_dir, flag = tmp_path / "killed", tmp_path / "writing"
    sigkill_once_flagged(
        KILL_SCRIPT.format(root=str(ROOT), tests=str(HERE), signal=str(flag), run_dir=str(run_dir)),
        flag,
    )
    assert [p.name for p in checkpoint.checkpoints_in(run_dir)] == ["update_1", "update_2"]
    assert (run_dir / "checkpoints" / ".update_3.tmp").is_dir()  # the torn write, invisible
    report = run_in_process(run_dir)  # auto-resume from update_2, in the same folder
    assert report["resume"]["resumed_from"].endswith("update_2")
    assert first_difference(reference, run_dir)[1] is None
    # Said, not skipped silently (an audit's finding): the resume goes on from the last whole checkpoint.
    assert (
        f"{run_dir / 'checkpoints'}: the checkpoint of update 3 was cut short while it was written (its run stopped "
        "then): resuming from update 2, the last whole one"
    ) in caplog.text


def test_the_peft_adapter_reproduces_the_trained_students_log_probs(tmp_path):
    cfg = compose_config([*ARGS, "recipe.optimizer_updates=2"])
    trainer = OPDTrainer(to_config(cfg), resolved_config(cfg), tmp_path / "run")
    trainer.setup()
    trainer.train()
    report = trainer.finish()
    adapter_dir = tmp_path / "run" / "peft_adapter"
    assert report["artifacts"]["standard_peft_adapter_sha256"] == sha256_file(adapter_dir / "adapter_model.safetensors")
    block = trainer.cfg.model
    base = models.load_causal_lm(
        "model", block, models.source_of(block, tmp_path / "run" / "toy_models" / "student"), torch.device("cpu")
    )
    loaded = PeftModel.from_pretrained(base, adapter_dir).eval()
    t = load_file(str(tmp_path / "run" / "trajectories" / "update_000002.safetensors"))
    batch = Batch(**{k: v for k, v in t.items() if k in Batch.__dataclass_fields__})
    with torch.no_grad():
        trainer.student.eval()
        ours = response_log_probs(trainer.student.get_base_model(), batch)
        theirs = response_log_probs(loaded.get_base_model(), batch)
    torch.testing.assert_close(theirs, ours, rtol=1e-6, atol=1e-6)
    assert not torch.equal(ours, torch.as_tensor(t["old_log_probs"]))  # the adapter moved since that rollout


@pytest.mark.slow
@pytest.mark.parametrize(
    "keep,kept,kept_at_the_end", [(None, [2, 3], [3, 4]), ("null", [1, 2, 3], [1, 2, 3, 4]), (1, [3], [4])]
)
def test_a_run_keeps_its_newest_checkpoints_two_by_default_and_resume_still_works(
    reference, tmp_path, keep, kept, kept_at_the_end
):
    folder = tmp_path / "run"
    setting = [] if keep is None else [f"trainer.max_actor_ckpt_to_keep={keep}"]
    run_in_process(folder, "trainer.stop_after_updates=3", *setting)
    assert [p.name for p in checkpoint.checkpoints_in(folder)] == [f"update_{u}" for u in kept]
    report = run_in_process(folder, *setting)  # auto-resume from update_3
    assert report["resume"]["resumed_from"].endswith("update_3")
    assert [p.name for p in checkpoint.checkpoints_in(folder)] == [f"update_{u}" for u in kept_at_the_end]
    assert first_difference(reference, folder)[1] is None


# ------------------------------------------------------------------ the recipe's resume check
@pytest.mark.slow
def test_a_resumed_child_that_started_afresh_fails_the_resume_check(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_in_process(run_dir)

    def ignores_resume_from(overrides, extra, child_dir):
        if any(e.startswith("trainer.resume_from=") for e in extra):
            extra = ["trainer.resume_mode=disable"]  # the same plan from scratch: byte-equal, yet no resume
        # In this process: what is checked is the verdict, not the process (test_cli checks that).
        run(compose_config([*overrides, *extra, "trainer.progress_bar=false"]), child_dir)

    monkeypatch.setattr(resume_check, "run_child", ignores_resume_from)
    block = resume_check.verify_resume(run_dir, ARGS, 2)
    stop_ckpt = run_dir / "resume_check" / "interrupted" / "checkpoints" / "update_2"
    assert block["status"] == "mismatch"
    assert block["first_difference"].startswith(f"the resumed run did not resume from {stop_ckpt} after update 2")
    assert block["resumed_from_checkpoint"] is None and block["resumed_after_update"] is None
    assert block["adapter_and_optimizer_byte_identical"] and block["trajectories_byte_identical"]  # bytes alone pass


@pytest.mark.slow
def test_the_parent_releases_its_models_before_the_resume_checks_children_run(tmp_path, monkeypatch):
    loaded = []

    def recording(real):
        def load(*args, **kwargs):
            model = real(*args, **kwargs)
            loaded.append(weakref.ref(model))
            return model

        return load

    for name in ("load_student", "load_teacher"):
        monkeypatch.setattr(models, name, recording(getattr(models, name)))
    alive_at_children = []

    def child(overrides, extra, run_dir):
        alive_at_children.append([ref() is not None for ref in loaded])
        raise RuntimeError("no child in this test")

    monkeypatch.setattr(resume_check, "run_child", child)
    run_dir = tmp_path / "run"
    args = [a for a in ARGS if not a.startswith("recipe.interrupt_after_updates")]
    with pytest.raises(MiniverlError, match="resume check failed: the interrupted or resumed run failed"):
        run(compose_config([*args, "recipe.interrupt_after_updates=1", "recipe.optimizer_updates=2"]), run_dir)
    assert len(loaded) == 2 and alive_at_children == [[False, False]]
    report = json.loads((run_dir / "report.json").read_text())  # rebuilt after the check, without the models
    assert report["status"] == "measured" and report["resume"]["status"] == "mismatch"
    assert report["artifacts"]["standard_peft_adapter_sha256"] == sha256_file(
        run_dir / "peft_adapter" / "adapter_model.safetensors"
    )
    assert report["measurements"]["steady_state_median_seconds"]["rollout"] > 0


# ------------------------------------------------------------------ a run that died before its first checkpoint
def dead_run(folder, plan_json: bytes):
    """What a run killed during update 1 leaves: its plan, config, a trajectory, no checkpoint."""
    (folder / "trajectories").mkdir(parents=True)
    (folder / "plan.json").write_bytes(plan_json)
    (folder / "resolved_config.yaml").write_text("killed: true\n")
    (folder / "trajectories" / "update_000001.safetensors").write_bytes(b"partial")
    (folder / "checkpoints" / ".update_1.tmp").mkdir(parents=True)  # a torn checkpoint write
    return folder


def test_a_folder_whose_run_of_this_plan_died_before_a_checkpoint_is_started_again(reference, tmp_path):
    plan_json = (reference / "plan.json").read_bytes()
    folder = dead_run(tmp_path / "dead", plan_json)
    RunFolder(folder, plan_digest=sha256_file(reference / "plan.json"))
    assert sorted(p.name for p in folder.iterdir()) == ["trajectories"]
    assert not list((folder / "trajectories").iterdir())


@pytest.mark.parametrize("leftover", ["another plan", "a report", "a checkpoint", "no plan digest"])
def test_a_died_run_is_not_started_again_over_another_plan_a_report_or_a_checkpoint(reference, tmp_path, leftover):
    folder = dead_run(tmp_path / "dead", (reference / "plan.json").read_bytes())
    digest = sha256_file(reference / "plan.json")
    if leftover == "another plan":
        digest = "0" * 64
    elif leftover == "a report":
        (folder / "report.json").write_text('{"status": "measured"}')  # a failed one in update 1 starts again
    elif leftover == "a checkpoint":
        (folder / "checkpoints" / "update_1").mkdir()
    before = tree_digest(folder)
    with pytest.raises(MiniverlError, match="already holds a run") as info:
        RunFolder(folder, plan_digest=None if leftover == "no plan digest" else digest)
    assert "\n" not in str(info.value)
    # A new-user audit followed "resume it with trainer.resume_from" to a folder without a checkpoint, which
    # resume_from then refused pointing back here: the way out offered is only one that works.
    offers_resume = f"resume it with trainer.resume_from={folder}" in str(info.value)
    assert offers_resume == (leftover == "a checkpoint")
    assert ("no checkpoint to resume" in str(info.value)) != offers_resume
    assert tree_digest(folder) == before


HANG_BEFORE_CHECKPOINT = """
import sys, time
from pathlib import Path
sys.path[:0] = [{root!r}, {root!r} + "/tests", {tests!r}]  # conftest, and this test module
from miniverl.utils import checkpoint
def hang(*args, **kwargs):
    Path({signal!r}).write_text("update 1 done, no checkpoint yet")
    time.sleep(120)
checkpoint.save_checkpoint = hang
from test_resume import run_in_process
run_in_process(Path({run_dir!r}))
"""


@pytest.mark.slow
def test_the_same_command_restarts_a_run_killed_before_its_first_checkpoint(reference, tmp_path, capfd):
    run_dir, flag = tmp_path / "killed", tmp_path / "flag"
    sigkill_once_flagged(
        HANG_BEFORE_CHECKPOINT.format(root=str(ROOT), tests=str(HERE), signal=str(flag), run_dir=str(run_dir)),
        flag,
    )
    assert (run_dir / "plan.json").is_file() and not checkpoint.checkpoints_in(run_dir)
    assert (run_dir / "trajectories" / "update_000001.safetensors").is_file()

    capfd.readouterr()
    assert run_as_command("main", *ARGS, f"hydra.run.dir={run_dir}") == 0  # the same command
    assert (
        "stopped before its first checkpoint (no checkpoint; no report, or a failed one): this command's run takes "
        "its place" in capfd.readouterr().out
    )
    assert json.loads((run_dir / "report.json").read_text())["status"] == "measured"
    assert first_difference(reference, run_dir)[1] is None


@pytest.mark.slow
def test_a_resume_after_its_model_folder_was_saved_again_with_other_weights_is_refused_naming_the_folder(tmp_path):
    """A local folder is read by path: a student saved again at the same path (a re-export) would train
    on under the old checkpoint's adapter. Its digest is part of the plan, so the resume is refused
    in one line that names the folder, and goes on once the weights are back."""
    from safetensors.torch import save_file

    from conftest import toy_model_folders

    folders = toy_model_folders(tmp_path / "models")
    own = [
        "+recipe=opd_k1",
        "hardware=cpu",
        f"model.model_id={folders['student']}",
        f"teacher.model_id={folders['teacher']}",
        "recipe.optimizer_updates=2",
        "recipe.interrupt_after_updates=null",
        "recipe.response_limit=8",
        "trainer.progress_bar=false",
    ]
    stopped = tmp_path / "stopped"
    assert run(compose_config([*own, "trainer.stop_after_updates=1"]), stopped)["status"] == "interrupted"
    weights = folders["student"] / "model.safetensors"
    saved = weights.read_bytes()
    save_file({name: t + 1e-2 for name, t in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
    with pytest.raises(MiniverlError) as info:
        run(compose_config([*own, f"trainer.resume_from={stopped}"]), tmp_path / "resumed")
    line = str(info.value)
    assert "\n" not in line and "belongs to another plan" in line
    assert (
        f"the files of model.model_id={folders['student']} changed since that run: resume with them as they were"
        in line
    )
    # Another folder named (here with other weights too) is no edit: a new-user audit was told its folders
    # "changed since that run". The line names the folder the run had, to resume with.
    other = tmp_path / "models" / "student_copy"
    shutil.copytree(folders["student"], other)
    with pytest.raises(MiniverlError) as info:
        run(compose_config([*own, f"model.model_id={other}", f"trainer.resume_from={stopped}"]), tmp_path / "named")
    line = str(info.value)
    assert "changed since that run" not in line and f"resume with model.model_id={folders['student']}" in line
    weights.write_bytes(saved)
    report = run(compose_config([*own, f"trainer.resume_from={stopped}"]), tmp_path / "resumed")
    assert report["resume"]["status"] == "resumed"
    # A checkpoint of a miniverl whose plans did not hold the folders' digests still resumes, unchecked.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("miniverl.trainer.plan.FOLDER_KEYS", ())
        run(compose_config([*own, "trainer.stop_after_updates=1"]), tmp_path / "earlier")
    assert (
        run(compose_config([*own, f"trainer.resume_from={tmp_path / 'earlier'}"]), tmp_path / "later")["resume"][
            "status"
        ]
        == "resumed"
    )


@pytest.mark.slow
def test_a_resume_after_its_training_data_was_edited_is_refused_naming_the_data(tmp_path):
    """A new-user audit edited one prompt of its parquet between the stop and the resume: the refusal said
    to resume "with the overrides of the run that wrote it", which were the same."""
    import pyarrow.parquet as pq

    data = tmp_path / "mine.parquet"
    table = pq.read_table(ROOT / "data" / "toy_prompts.parquet")
    pq.write_table(table, data)
    own = ["+recipe=opd_k1", "model=toy", "teacher=toy", "hardware=cpu", f"data.train_files={data}"]
    own += ["recipe.optimizer_updates=2", "recipe.interrupt_after_updates=null", "recipe.response_limit=8"]
    stopped = tmp_path / "stopped"
    assert run(compose_config([*own, "trainer.stop_after_updates=1"]), stopped)["status"] == "interrupted"
    rows = table.to_pylist()
    rows[0]["prompt"][-1]["content"] += " Answer in words."
    pq.write_table(type(table).from_pylist(rows, schema=table.schema), data)
    with pytest.raises(MiniverlError) as info:
        run(compose_config([*own, f"trainer.resume_from={stopped}"]), tmp_path / "resumed")
    assert "the files of data.train_files changed since that run: resume with them as they were" in str(info.value)


def test_a_check_run_again_while_a_run_of_the_earlier_check_goes_on_is_refused_and_takes_nothing_of_it(tmp_path):
    """A lose-work audit: a run of the resume check, left running by a command killed with SIGKILL, wrote its
    checkpoint into the folders the command run again had made afresh for its own check, whose verdict became
    a mismatch for good. Its folder's lock (held here, as that run holds it) refuses the new check first."""
    from miniverl.utils.run_folder import flock_folder

    twin = tmp_path / "resume_check" / "interrupted"
    (twin / "checkpoints").mkdir(parents=True)
    held = flock_folder(twin)
    try:
        with pytest.raises(MiniverlError) as refused:
            resume_check.verify_resume(tmp_path, ["+recipe=opd_k1"], 1)
    finally:
        os.close(held)
    assert str(refused.value) == (
        f"resume check: {twin} is in use by a run of an earlier check, still going on (left by a command that was "
        "killed); wait until it ends, then run the same command again"
    )
    assert (twin / "checkpoints").is_dir()  # nothing of it removed


def test_the_resume_checks_runs_are_started_to_die_with_the_command(tmp_path, monkeypatch):
    """tests/utils/test_signals.py shows such a child dies with its parent; here, that the check's runs are one."""
    from miniverl.utils.signals import die_with_parent

    started = {}

    def popen(command, **kwargs):
        started.update(kwargs)
        raise OSError("not started")

    monkeypatch.setattr(resume_check.subprocess, "Popen", popen)
    with pytest.raises(OSError):
        resume_check.run_child(["+recipe=opd_k1"], [], tmp_path)
    assert started["preexec_fn"].func is die_with_parent and started["preexec_fn"].args == (os.getpid(),)
