"""A checkpoint's state.json: what it keeps beside the LoRA weights and the optimizer, enough for a
resume to go on as the uninterrupted run would, byte for byte (docs/resume.md). The resume check
compares the training fields of two runs' (resume_check.TRAINING_STATE_FIELDS)."""

from __future__ import annotations

from miniverl.trainer.validation import probe_owed
from miniverl.utils.identity import sha256_json
from miniverl.utils.numerics import NUMERICS_FIELD, numerics_environment


def checkpoint_state(trainer, update: int) -> dict:
    """The state of `trainer` (an OPDTrainer) after `update` updates, for its checkpoint."""
    plan, out = trainer.plan, trainer.out
    owed = probe_owed(trainer.progress, update, trainer.cfg.eval.every, len(plan.updates))
    return {
        "global_optimizer_steps": update,
        "task_cursor": plan.task_cursor(update),
        "compiled_plan_sha256": plan.digest,
        "resolved_config_digest": sha256_json(trainer.resolved),
        "run_seed": trainer.cfg.trainer.seed,
        "random_streams": "derived: plan.updates[k].sample_seeds",  # from the seed: no generator state
        "trajectory_digests": list(out.trajectory_digests),
        "trajectory_sha256": out.trajectory_sha256,
        "history": trainer.history,
        "distillation_progress": trainer.progress,
        "downshift": trainer.downshift.state(),  # a resumed run goes on at the sizes this run had halved to
        "eval_downshift": trainer.eval_downshift.state(),  # the probe's own; the resume check leaves it out
        # Not where the probe after the final update failed: the resume measures it (OPDTrainer.evaluate_owed).
        "finished": update == len(plan.updates) and not owed,
        NUMERICS_FIELD: numerics_environment(trainer.device),  # a resume elsewhere is refused or marked inexact
        # trainer.resume_inexact's changes so far: a later exact resume of this run reports them still.
        "inexact_because": trainer.resumed.inexact_because if trainer.resumed is not None else [],
    }
