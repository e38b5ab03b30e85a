"""Schema of `conf/export/`: the release and the scale of the verl launch that `python -m miniverl.export`
writes (not part of the compiled plan: exporting never changes a run).

verl runs the student (FSDP actor + its rollout engine, colocated: verl's hybrid engine) on the
trainer pool, `nnodes` x `n_gpus_per_node` GPUs, and the frozen teacher on an inference engine in
its own pool, `teacher_nnodes` x `teacher_n_gpus_per_node` GPUs, split into `teacher_replicas`
replicas of `teacher_tensor_parallel_size` GPUs each. The defaults are the smallest valid verl setup:
one trainer GPU plus one teacher GPU. The checks here are the ones verl makes at run time about these
knobs alone; the ones that also need the recipe (batch divisibility, context length) run when the
export is built (`miniverl.export`).

Named after its config group (one schema module per `conf/<group>/`), as the `export` command
is (miniverl/export.py); the export itself is miniverl/verl_compat/launch_writer.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# The verl releases the export writes for (what each one is: miniverl/verl_compat/versions.py). 0.9.1 is what
# `pip install verl` gives today; 0.8.0 is the release miniverl's losses mirror.
VERL_VERSIONS = ("0.8.0", "0.9.1")
VERL_VERSION_DEFAULT = "0.9.1"
# The folder of the run folder that `python -m miniverl.export` writes the launch into.
EXPORT_FOLDER = "verl"
# Inference engines verl v0.8.0 and v0.9.1 can serve the teacher with (its top-k log-prob path knows these two).
ENGINES = ("vllm", "sglang")


@dataclass
class ExportConfig:
    # The verl release the launch is written for: 0.9.1 (what `pip install verl` gives) or 0.8.0
    # (docs/verl-versions.md says what differs).
    verl_version: str = VERL_VERSION_DEFAULT
    nnodes: int = 1  # verl: trainer.nnodes
    n_gpus_per_node: int = 1  # verl: trainer.n_gpus_per_node (the trainer pool: actor + rollout)
    teacher_nnodes: int = 1  # verl: distillation.nnodes
    teacher_n_gpus_per_node: int = 1  # verl: distillation.n_gpus_per_node (the teacher pool)
    teacher_replicas: int = 1  # verl: distillation.teacher_models.teacher_model.num_replicas
    teacher_tensor_parallel_size: int = 1  # verl: ...teacher_model.inference.tensor_model_parallel_size
    teacher_gpu_memory_utilization: float = 0.5  # verl: ...teacher_model.inference.gpu_memory_utilization
    rollout_name: str = "vllm"  # verl: actor_rollout_ref.rollout.name (the teacher is served by the same engine)
    rollout_tensor_parallel_size: int = 1  # verl: actor_rollout_ref.rollout.tensor_model_parallel_size
    rollout_gpu_memory_utilization: float = 0.5  # verl: actor_rollout_ref.rollout.gpu_memory_utilization
    # Rows per actor forward/backward on each GPU (verl: actor.ppo_micro_batch_size_per_gpu);
    # null: hardware.update_chunk, miniverl's own update chunk.
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    # Rows per old-log-prob forward on each GPU (verl: rollout.log_prob_micro_batch_size_per_gpu);
    # null: the same as the actor's micro-batch.
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    # verl: actor.use_dynamic_bsz (token-budget micro-batches instead of fixed row counts).
    use_dynamic_bsz: bool = False
    # Token budget per GPU with use_dynamic_bsz (verl: actor.ppo_max_token_len_per_gpu and
    # rollout.log_prob_max_token_len_per_gpu); null: verl's default, 16384.
    max_token_len_per_gpu: Optional[int] = None
    # A teacher with a privileged context (teacher.context) cannot be exported (verl's teacher sees
    # the student's prompt); true: export it with the context dropped, and say so.
    drop_teacher_context: bool = False

    def __post_init__(self) -> None:
        where = "export"
        if self.verl_version not in VERL_VERSIONS:
            raise ValueError(
                f"{where}.verl_version={self.verl_version!r}: miniverl exports for verl {' or '.join(VERL_VERSIONS)}"
            )
        for key in (
            "nnodes",
            "n_gpus_per_node",
            "teacher_nnodes",
            "teacher_n_gpus_per_node",
            "teacher_replicas",
            "teacher_tensor_parallel_size",
            "rollout_tensor_parallel_size",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"{where}.{key}={getattr(self, key)} must be >= 1 (verl needs a non-empty pool)")
        for key in ("ppo_micro_batch_size_per_gpu", "log_prob_micro_batch_size_per_gpu", "max_token_len_per_gpu"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{where}.{key}={value} must be >= 1 (or null)")
        for key in ("teacher_gpu_memory_utilization", "rollout_gpu_memory_utilization"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"{where}.{key}={getattr(self, key)} must be in (0, 1]")
        if self.rollout_name not in ENGINES:
            raise ValueError(f"{where}.rollout_name={self.rollout_name!r}; choose one of {', '.join(ENGINES)}")
        replica = self.teacher_tensor_parallel_size
        per_node = self.teacher_n_gpus_per_node
        if (per_node % replica if replica <= per_node else replica % per_node) != 0:
            raise ValueError(
                f"{where}.teacher_tensor_parallel_size={replica} and teacher_n_gpus_per_node={per_node}: a teacher "
                "replica would straddle two nodes; make one a multiple of the other (verl refuses it)"
            )
        world = self.nnodes * self.n_gpus_per_node
        if world % self.rollout_tensor_parallel_size:
            raise ValueError(
                f"{where}.rollout_tensor_parallel_size={self.rollout_tensor_parallel_size} must divide the trainer's "
                f"nnodes x n_gpus_per_node = {world} GPUs (verl refuses it)"
            )
        if self.max_token_len_per_gpu is not None and not self.use_dynamic_bsz:
            raise ValueError(f"{where}.max_token_len_per_gpu is only used with export.use_dynamic_bsz=true")


def teacher_pool_problem(export: ExportConfig, teachers: int) -> str | None:
    """Why the teacher pool does not hold every teacher's replicas exactly (verl's
    DistillationConfig rule), or None. Checked by the export, which knows how many teachers there are."""
    pool = export.teacher_nnodes * export.teacher_n_gpus_per_node
    replica, replicas = export.teacher_tensor_parallel_size, export.teacher_replicas
    if pool == teachers * replicas * replica:
        return None
    each, needed = ("" if teachers == 1 else f"{teachers} teachers x "), teachers * replicas * replica
    nodes = export.teacher_nnodes if needed % export.teacher_nnodes == 0 else 1
    why = (  # verl: DistillationConfig's teacher_models
        "verl serves a single teacher with as many replicas as its pool holds, whatever num_replicas says"
        if teachers == 1
        else "verl checks the same at start-up"
    )
    return (
        f"export: the teacher pool (teacher_nnodes x teacher_n_gpus_per_node = {pool} GPUs) must equal "
        f"{each}teacher_replicas x teacher_tensor_parallel_size = {each}{replicas} x {replica} = {needed} ({why}): "
        f"e.g. export.teacher_nnodes={nodes} export.teacher_n_gpus_per_node={needed // nodes}"
    )
