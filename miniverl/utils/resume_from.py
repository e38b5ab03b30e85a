"""Which checkpoint a run resumes from, and whether it may: trainer.resume_from (a checkpoint or a run
folder), this folder's own with resume_mode auto, and every check a resume needs before anything is
written (files whole, the same plan, the earlier trajectories intact, this process computing as the one
that wrote it). A refusal is one line naming what differs and the way on."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from miniverl.config.trainer import TrainerConfig
from miniverl.utils.checkpoint import (
    TENSOR_FILES,
    Checkpoint,
    checkpoint_update,
    checkpoints_in,
    trajectory_path,
)
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import FOLDER_DIGESTS, sha256_file
from miniverl.utils.numerics import numerics_environment, refused_numerics
from miniverl.utils.overrides import hydra_value, override_key, shell_override
from miniverl.utils.run_folder import earlier_report
from miniverl.utils.run_names import PLAN, STATE
from miniverl.utils.tables import flatten


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder meaning its latest checkpoint."""
    path = Path(path)
    if (path / STATE).is_file():
        return path
    if not path.exists():
        raise MiniverlError(
            f"trainer.resume_from={path}: no such folder (relative to {Path.cwd()}); give the run folder of the "
            "stopped run (outputs/<date>/<time>) or one of its checkpoints/update_<k>/"
        )
    found = checkpoints_in(path)
    run_without_checkpoint = not found and (path / PLAN).is_file()
    # A stopped or finished run checkpointed: its checkpoints/ was removed since.
    if run_without_checkpoint and earlier_report(path).get("status") in ("interrupted", "measured"):
        raise MiniverlError(
            f"trainer.resume_from={path}: that run's checkpoints/ is gone (removed or moved), so nothing is left "
            f"to resume; start the run anew: in another hydra.run.dir, or in {path} with trainer.overwrite=true"
        )
    if run_without_checkpoint:  # a run stopped (SIGKILL, a failure) before its first save
        raise MiniverlError(
            f"trainer.resume_from={path}: that run stopped before its first checkpoint, so nothing is left to "
            f"resume; run the command that started it again (with hydra.run.dir={path} it starts again in that "
            "folder, from where that command started)"
        )
    if not found:
        raise MiniverlError(
            f"trainer.resume_from={path}: neither a checkpoint folder (no {STATE}) "
            "nor a run folder with checkpoints/update_<k>/ (a run writes them every trainer.save_freq "
            "updates, and when it stops)"
        )
    return found[-1]


# The plan's digest of a custom reward function's file (trainer/plan.py experiment_settings): in the
# plan's settings as if a config key, which it is not, so a refused resume names the file instead.
REWARD_FUNCTION_DIGEST = "reward.custom_reward_function.sha256"


def digested_key(override: str) -> str | None:
    """The config key whose file or folder an override of earlier_overrides sets the digest of
    (model.model_id for model.folder_sha256.model_id); None for an override of a config key."""
    key = override_key(override)
    if key == REWARD_FUNCTION_DIGEST:
        return "reward.custom_reward_function.path"
    block, found, name = key.partition(f".{FOLDER_DIGESTS}.")
    return f"{block}.{name}" if found else None


def edited_files(override: str, settings: dict) -> str | None:
    """What an override of earlier_overrides names when it sets a file's or folder's digest rather than a
    config key ("the files of model.model_id=<folder>"); None for a config key."""
    key = digested_key(override)
    if key is None:
        return None
    if key == "reward.custom_reward_function.path":
        return f"the file of {key}"
    return f"the files of {key}={flatten(settings).get(key)}"


def earlier_plan(run_dir: Path) -> dict:
    """The plan.json of the run in `run_dir` ({} where there is none to read)."""
    try:
        return json.loads((run_dir / PLAN).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def reordered(run_dir: Path, prompt_rows: list[list[int]]) -> bool:
    """Whether the run in `run_dir` planned other prompts per update than `prompt_rows`."""
    planned = [list(update["prompt_rows"]) for update in earlier_plan(run_dir).get("updates", [])]
    return bool(planned) and planned != prompt_rows


def earlier_overrides(run_dir: Path, settings: dict) -> list[str]:
    """`key=value` overrides that give a run whose plan holds `settings` (plan.json's "settings":
    every config field that shapes the experiment) those of the run in `run_dir`, where they differ:
    what a refused resume needs, for instance after a recipe changed between versions."""
    try:
        before = flatten(earlier_plan(run_dir)["settings"])
    except (KeyError, TypeError):
        return []
    now = flatten(settings)
    differing = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k) and k != "miniverl_version")
    return [f"{key}={hydra_value(before[key])}" if key in before else f"~{key}" for key in differing]


def resume_instead(path: Path) -> str:
    """What to resume instead of the checkpoint at `path` (checkpoints/update_<k> of a run folder)."""
    if path not in checkpoints_in(path.parent.parent):  # a checkpoint folder copied under another name
        return "resume from an earlier checkpoint"
    earlier = [c for c in checkpoints_in(path.parent.parent) if checkpoint_update(c) < checkpoint_update(path)]
    if earlier:
        return "resume from an earlier checkpoint: " + shell_override("trainer.resume_from", earlier[-1])
    return "no earlier checkpoint of that run: start it anew (another hydra.run.dir, or trainer.overwrite=true there)"


def verify_checkpoint(
    path: str | Path,
    plan_digest: str,
    settings: dict | None = None,
    run_dir: Path | None = None,
    numerics: tuple[dict, bool] | None = None,
    legacy_digests: tuple[str, ...] = (),
    input_digest: str | None = None,
    prompt_rows: list[list[int]] | None = None,
) -> Checkpoint:
    """Every check a resume needs, reading only: files present, hashes right, same plan, and the
    earlier trajectory files of its run present and intact. `run_dir`: the folder of the run that
    resumes (a refusal then says how to start a new run there instead). `numerics`: this process's
    kernel environment and whether trainer.resume_inexact lets another one go on; checked before the
    plan, whose CPU-resolved settings another environment changes too. `legacy_digests`: what this plan's
    digest was under an earlier miniverl that recorded less of it, also accepted. `input_digest`: this
    plan's digest of the training data (a refusal names data.train_files when it differs from that run's).
    `prompt_rows`: each update's prompts in this plan (a refusal says when only their order differs)."""
    path = resolve_checkpoint(path)
    where = f"checkpoint {path}"  # trainer.resume_from's, or this folder's own (trainer.resume_mode=auto)
    missing = [name for name in (*TENSOR_FILES, STATE) if not (path / name).is_file()]
    if missing:
        raise MiniverlError(f"{where} is incomplete: missing {', '.join(missing)}; {resume_instead(path)}")
    try:
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
        files = state["files"]
    except (ValueError, KeyError, TypeError):
        raise MiniverlError(f"{where}: {STATE} is not a miniverl checkpoint state; {resume_instead(path)}") from None
    for name in TENSOR_FILES:
        if sha256_file(path / name) != files.get(name):
            raise MiniverlError(
                f"{where}: {name} does not match its sha256 in {STATE} (corrupted); {resume_instead(path)}"
            )
    checkpoint = Checkpoint(path, state)
    # First: a finished run cannot be resumed under any settings, so naming its plan's overrides would mislead.
    # One stopped while it wrote its report (a signal, a full disk, a kill) resumes to write it: nothing to train.
    reported = earlier_report(checkpoint.run_dir).get("status") == "measured"
    if checkpoint.update >= len(state["history"]) and state.get("finished") and reported:
        raise MiniverlError(
            f"{checkpoint.run_dir} already holds a finished run ({path.name} is its last update): "
            "nothing is left to resume; start a new run in another hydra.run.dir without trainer.resume_from, "
            "or replace that run in its own folder with trainer.overwrite=true"
        )
    if numerics is not None:
        checkpoint.numerics_changes = refused_numerics(checkpoint, *numerics)
    if state.get("compiled_plan_sha256") not in (plan_digest, *legacy_digests):
        overrides = earlier_overrides(checkpoint.run_dir, settings) if settings is not None else []
        edited = [o for o in overrides if edited_files(o, settings)]  # no config key: a file's or folder's digest
        overrides = [o for o in overrides if o not in edited]
        how = (
            f"resume with {' '.join(overrides)}" if overrides else "resume with the overrides of the run that wrote it"
        )
        named = {override_key(o) for o in overrides}  # a folder named anew was not edited
        changed = list(dict.fromkeys(edited_files(o, settings) for o in edited if digested_key(o) not in named))
        before = earlier_plan(checkpoint.run_dir).get("input_parquet_sha256")
        if input_digest is not None and before not in (None, input_digest):  # the prompts' bytes
            changed.insert(0, "the files of data.train_files")
        if changed:
            how = f"{' and '.join(changed)} changed since that run: resume with them as they were" + (
                f" and {' '.join(overrides)}" if overrides else ""
            )
        elif not overrides and prompt_rows is not None and reordered(checkpoint.run_dir, prompt_rows):
            how = (  # the same settings: an earlier miniverl's order (before verl's dataloader's, 2026-12-07)
                "its plan takes the prompts in another order, an earlier miniverl's (the order is verl's dataloader's "
                "since 2026-12-07: a shuffle, and a pass's last partial batch, differ), so it cannot go on exactly "
                "here; go on with the miniverl that started it"
            )
        if run_dir is None or checkpoint.run_dir.resolve() == Path(run_dir).resolve():
            new_run = "another hydra.run.dir (or replace that run with trainer.overwrite=true)"
        else:  # named by trainer.resume_from: the new run's folder is free of it
            new_run = "drop trainer.resume_from"
        raise MiniverlError(
            f"{where} belongs to another plan (compiled_plan_sha256 {str(state.get('compiled_plan_sha256'))[:12]}"
            f"... != {plan_digest[:12]}... of this command): {how}, or for a new run {new_run}"
        )
    for update, digest in enumerate(state["trajectory_digests"], start=1):
        source = trajectory_path(checkpoint.run_dir, update)
        if not source.is_file() or sha256_file(source) != digest:
            earlier = [c for c in checkpoints_in(checkpoint.run_dir) if checkpoint_update(c) < update]
            way = (
                f"resume from {earlier[-1]}, whose updates come before it (trainer.resume_from={earlier[-1]})"
                if earlier
                else "no checkpoint of that run comes before it: start the run anew (another hydra.run.dir, or "
                "trainer.overwrite=true in its folder)"
            )
            raise MiniverlError(
                f"{where}: its run's trajectory {source} is missing or altered; the resumed run needs every earlier "
                f"update's trajectory: {way}"
            )
    return checkpoint


def resume_source(trainer_config: TrainerConfig, run_dir: Path) -> Path | None:
    """Where a run resumes from: trainer.resume_from, or with resume_mode auto this folder's latest
    checkpoint; None to start fresh. trainer.overwrite empties this folder, so the auto mode finds
    nothing here to resume, but a trainer.resume_from naming another folder is still resumed: the
    resume check's twin gets the command's overrides, overwrite included, and once started afresh
    when its checkpoint was ignored."""
    if trainer_config.resume_mode == "disable":
        return None
    if trainer_config.resume_from:
        source = Path(trainer_config.resume_from)
        if trainer_config.overwrite and source.resolve().is_relative_to(Path(run_dir).resolve()):
            raise MiniverlError(
                f"trainer.resume_from={source} is in the run folder that trainer.overwrite=true would empty "
                f"({run_dir}); drop trainer.overwrite to resume that run, or trainer.resume_from to replace it"
            )
        return source
    return None if trainer_config.overwrite or not checkpoints_in(run_dir) else run_dir


def checkpoint_to_resume(trainer_config: TrainerConfig, run_dir: Path, plan, device: torch.device) -> Checkpoint | None:
    """The checkpoint this run resumes from, verified (`resume_source`, `verify_checkpoint`, and that this
    process on `device` computes as the one that wrote it); None: a fresh start. `plan`: the run's
    compiled plan (trainer/plan.Plan: its digest and settings)."""
    source = resume_source(trainer_config, run_dir)
    if source is None:
        return None
    numerics = (numerics_environment(device), trainer_config.resume_inexact)
    legacy = (plan.digest_before_folder_digests,)  # checkpoints written before plans held the folders' digests
    rows = [list(update.prompt_rows) for update in plan.updates]
    return verify_checkpoint(
        source, plan.digest, plan.settings, run_dir, numerics, legacy, plan.input_parquet_sha256, rows
    )
