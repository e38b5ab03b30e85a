"""Why a verl override has no miniverl field: the reasons the import writes beside each override it
does not import (verl_compat/import_verl.py), kept apart from the mapping itself. verl's engine
settings are set apart: they say how verl runs, not what it computes.
"""

from __future__ import annotations

from miniverl.verl_compat.defaults import ACTOR, MODEL, TEACHERS
from miniverl.verl_compat.field_rules import RULES

# verl settings of how it runs, not of what it computes (parallelism, sharding, offload, kernels,
# padding removal, batch balancing, the reference model a launch without KL does not build): miniverl
# runs one device, so there is nothing to import, and nothing of the result is lost. Prefixes of verl keys.
ENGINE_SETTINGS = (
    f"{MODEL}.use_remove_padding",
    f"{MODEL}.use_fused_kernels",
    f"{ACTOR}.use_torch_compile",
    f"{ACTOR}.strategy",
    f"{ACTOR}.fsdp_config.",
    f"{ACTOR}.veomni.",
    f"{ACTOR}.megatron.",
    "actor_rollout_ref.ref.",
    "trainer.balance_batch",
)
# Engine knobs of a teacher_models entry (its inference engine's), by their key under the entry.
TEACHER_ENGINE_KEYS = (
    "inference.expert_parallel_size",
    "inference.pipeline_model_parallel_size",
    "inference.enforce_eager",
)
# verl switches whose off value is what miniverl does, and why an on value does not carry over.
NOT_IN_MINIVERL = {
    "algorithm.use_kl_in_reward": "a KL penalty in the reward: on-policy distillation in miniverl has none",
    f"{ACTOR}.use_kl_loss": "a KL loss to a reference policy: on-policy distillation in miniverl has none",
}
# verl keys with no miniverl field, and why (the rest say "no miniverl field").
NO_FIELD_WHY = {
    "data.image_key": "images: miniverl trains text-only causal LMs",
    "trainer.test_freq": "verl validates the task reward on data.val_files every test_freq steps; miniverl's "
    "held-out measurement is the student-teacher KL (eval.every)",
}
ENGINE_WHY = "verl engine setting: how verl runs (parallelism, offload, kernels), not what it computes"
REFUSED_WHY = "verl refuses the launch at run time"  # runtime_checks' lines on the launch as written

# verl keys of a later release than the launch's: {key: the release that added it}.
NEWER = {
    **{key: rule.since for rule in RULES if rule.since for key in rule.verl_keys},
    **{key: since for rule in RULES for key, since in rule.later_keys},
}


def why_not_imported(key: str, version: str) -> str:
    """The reason a verl override of a `version` launch, read by no rule, is not imported."""
    if key in NEWER:
        return f"verl {version} has no such key (new in verl {NEWER[key]})"
    engine = any(key == p or (p.endswith(".") and key.startswith(p)) for p in ENGINE_SETTINGS)
    if engine or (key.startswith(f"{TEACHERS}.") and key.split(".", 3)[-1] in TEACHER_ENGINE_KEYS):
        return ENGINE_WHY
    return NO_FIELD_WHY.get(key, "no miniverl field")
