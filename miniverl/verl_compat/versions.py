"""The verl releases the export targets and the import reads: what each one is (tag, source) and
what differs between them for on-policy distillation, one fact each. Everything else of
miniverl's mapping to verl (field rules, defaults, run-time checks) is written once and reads the
release's facts from here (docs/verl-versions.md lists the differences for users).

v0.8.0 is the release whose semantics miniverl mirrors (the run report's `profile_identity`);
v0.9.1 is what `pip install verl` gives today, the export's default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miniverl import VERL_COMMIT
from miniverl.config.export import VERL_VERSION_DEFAULT, VERL_VERSIONS

ROLLOUT = "actor_rollout_ref.rollout"
LOSS = "distillation.distillation_loss"
# verl's get_custom_reward_fn reads it with .get(..., {}) (0.8.0 and 0.9.1)
REWARD_KWARGS = "reward.custom_reward_function.reward_kwargs"


@dataclass(frozen=True)
class VerlRelease:
    version: str  # "0.9.1": what export.verl_version names
    source: str  # the commit, or the PyPI wheel's sha256 where the release tag is not in the mirror we read
    # agg_loss's modes (verl/trainer/ppo/core_algos.py)
    loss_agg_modes: tuple[str, ...]
    # distillation_loss reads the normalisers the previous PPO loss call stored (the ordering behind #7200,
    # fixed by #7225 in 0.9.0): the first micro-batch of an update takes the previous update's token and row
    # counts (the very first its own), the others the current mini-batch's.
    distillation_reads_previous_normalisers: bool
    # A teacher inference temperature other than 1.0: refused at start-up (0.8.0), or warned and forced to 1.0
    # (#6867, 0.9.0).
    teacher_temperature_forced: bool
    # verl's DAPO reward rule (math_dapo, math, aime*) falls back to the last \boxed{} without an "Answer:" line
    # (0.9.0); miniverl's rule is 0.9.1's.
    dapo_boxed_fallback: bool
    # Keys this release reads that its YAML does not have (written with "+"), with the value it takes without
    # them: its dataclass's default, or the default of the code that reads the key.
    defaults_outside_yaml: dict[str, Any] = field(default_factory=dict)
    # YAML defaults that differ from v0.8.0's, and keys of its YAML v0.8.0's lacks (defaults.VERL_DEFAULTS is v0.8.0's).
    defaults_changed: dict[str, Any] = field(default_factory=dict)
    # What to install for its launch: 0.9.1's default trainer (trainer.use_v1: true, its TaskRunnerV1) imports
    # transfer_queue, which only the verl-core extra brings; a plain `pip install verl` stops there.
    requirement: str = ""

    @property
    def tag(self) -> str:
        return f"v{self.version}"


RELEASES: dict[str, VerlRelease] = {
    "0.8.0": VerlRelease(
        version="0.8.0",
        source=f"commit {VERL_COMMIT}",
        loss_agg_modes=("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
        distillation_reads_previous_normalisers=True,
        teacher_temperature_forced=False,
        dapo_boxed_fallback=False,
        defaults_outside_yaml={REWARD_KWARGS: {}},
        requirement="verl==0.8.0",
    ),
    "0.9.1": VerlRelease(
        version="0.9.1",
        # v0.9.1 was published to PyPI (2026-09-20) from a tag our mirror does not have: the wheel is the source.
        source="wheel verl-0.9.1-py3-none-any.whl, sha256 "
        "db6e6f2a8d9d5808d9ec32d357a42319fdc6967df688ff9d9810050f49bfdd14",
        loss_agg_modes=(
            "token-mean",
            "token-sum",
            "seq-mean-token-sum",
            "seq-mean-token-mean",
            "seq-mean-token-sum-norm",
        ),
        distillation_reads_previous_normalisers=False,
        teacher_temperature_forced=True,
        dapo_boxed_fallback=True,
        defaults_outside_yaml={
            REWARD_KWARGS: {},
            f"{LOSS}.use_chunked_topk": False,
            f"{LOSS}.chunked_topk_chunk_size": 4096,
        },
        defaults_changed={
            f"{ROLLOUT}.calculate_log_probs": True,
            f"{ROLLOUT}.full_determinism": False,  # new in 0.9.1 (0.8.0's YAML has neither)
            f"{ROLLOUT}.seed": 42,
        },
        requirement="verl[verl-core]==0.9.1",
    ),
}
assert tuple(RELEASES) == VERL_VERSIONS, "config/export.py's VERL_VERSIONS names the releases described here"
EXPORT_DEFAULT = VERL_VERSION_DEFAULT  # what `pip install verl` gives today
PROFILE_VERSION = "0.8.0"  # the release the run report's profile identity is tied to


def release(version: str) -> VerlRelease:
    """The release of `export.verl_version` (validated by ExportConfig)."""
    return RELEASES[version]
