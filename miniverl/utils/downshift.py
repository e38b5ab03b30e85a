"""Out-of-memory downshift: a rollout physical batch or an update chunk that raises
`torch.OutOfMemoryError` is retried at half the rows, until one row still fails.

The smaller size sticks for the rest of the run (retrying the big size every update would pay
the failure every time), a resumed run's included: checkpoints keep it (`state`, `for_hardware`).
Training and the held-out probe each have their own (`OPDTrainer.downshift`, `eval_downshift`):
the probe's halvings never change training's sizes, which the resume check compares.
Sampling streams are per sample, so a downshifted rollout draws the same uniforms; its tokens are
the same where the products of fewer rows give the same bits (float32 products), but in half
precision they round differently and a draw can flip (docs/resume.md). Hence the stickiness
across a resume: the resumed run computes with the sizes the uninterrupted one would.

For tests, `hardware.simulate_oom_above_rows=N` makes any forward of more than N rows raise
`torch.OutOfMemoryError` as the device would.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from miniverl.utils.measure import free_device_cache

log = logging.getLogger(__name__)
T = TypeVar("T")
# The rows of a rollout forward (hardware.rollout_physical_batch) and of every scoring forward
# (hardware.update_chunk): the actor's chunks, the teacher's and the probe's forwards all take
# update_chunk rows, so they halve together under one kind (the probe's in its own Downshift), named
# after that key and counted as the reference report's `update_chunk_oom`.
KINDS = ("rollout", "update_chunk")


def split(total: int, size: int) -> list[int]:
    """`total` rows in forwards of `size` rows, the last one smaller (the plan's and the downshift's split)."""
    return [min(size, total - start) for start in range(0, total, size)]


def named(kind: str) -> str:
    """ "a rollout", "an update chunk": a kind of forward in a sentence."""
    words = kind.replace("_", " ")
    return f"{'an' if words[0] in 'aeiou' else 'a'} {words}"


class OutOfMemoryAtOneRow(Exception):
    def __init__(self, kind: str, error: BaseException | str):
        super().__init__(
            f"out of memory in {named(kind)} of a single row ({error}); "
            "use a smaller recipe.response_limit or prompt_limit, a smaller model, or a larger device"
        )
        self.kind = kind


class Downshift:
    def __init__(self, device: torch.device, *, rollout_rows: int, update_rows: int, simulate_above: int | None):
        self.device = device
        self.rows = {"rollout": rollout_rows, "update_chunk": update_rows}
        self.counts = {f"{kind}_oom": 0 for kind in KINDS}
        self.observed: dict[str, set[int]] = {kind: set() for kind in KINDS}
        self.simulate_above = simulate_above
        self.committed = self.snapshot()  # as of the last complete update: what a checkpoint keeps

    @classmethod
    def for_hardware(cls, device: torch.device, hw, resumed=None, field: str = "downshift") -> Downshift:
        """The sizes of `hw` (a HardwareConfig) to start from, or those the checkpoint a run resumes
        from kept (`resumed`, a utils.checkpoint.Checkpoint: its state.json's `field`; training's
        `downshift`, or the held-out probe's own `eval_downshift`)."""
        shift = cls(
            device,
            rollout_rows=hw.rollout_physical_batch,
            update_rows=hw.update_chunk,
            simulate_above=hw.simulate_oom_above_rows,
        )
        kept = resumed.state.get(field) if resumed is not None else None
        if kept:  # a checkpoint older than this field has none: the sizes of `hw`
            shift.rows.update(kept["rows"])
            shift.counts.update(kept["batch_downshifts"])
            for kind, sizes in kept["observed_sizes"].items():
                shift.observed[kind].update(sizes)
            shift.commit()
        return shift

    def commit(self) -> None:
        """An update is complete (or, for the probe's own, a measurement): its sizes are the ones a
        checkpoint keeps, not those of an update or a probe that fails afterwards."""
        self.committed = self.snapshot()

    def state(self) -> dict:
        """What a checkpoint keeps: the sizes, downshifts and sizes used as of the last commit."""
        return self.committed

    def snapshot(self) -> dict:
        """The current sizes, the downshifts so far and the sizes used."""
        return {
            "rows": dict(self.rows),
            "batch_downshifts": dict(self.counts),
            "observed_sizes": {kind: sorted(sizes) for kind, sizes in self.observed.items()},
        }

    def run(self, kind: str, planned: Sequence[int], work: Callable[[list[int]], T]) -> T:
        """work(sizes), sizes the row counts of each forward: the `planned` ones (plan.json's) while
        they fit, else the rows split at the size out-of-memory halved them to (logged; the report
        counts the downshifts and lists the sizes used)."""
        while True:
            rows = self.rows[kind]
            sizes = list(planned) if max(planned) <= rows else split(sum(planned), rows)
            try:
                if self.simulate_above is not None and max(sizes) > self.simulate_above:
                    raise torch.OutOfMemoryError(
                        f"simulated: {max(sizes)} rows > hardware.simulate_oom_above_rows={self.simulate_above}"
                    )
                result = work(sizes)
            except torch.OutOfMemoryError as error:
                # Only the message leaves this block: the error's traceback holds the frames, and
                # through them the tensors, of the failed attempt.
                failure = str(error)
            else:
                self.observed[kind].update(sizes)
                return result
            # Out of the except block the failed attempt is unreferenced, so its memory can go
            # back (the collect breaks any frame cycles) before the retry needs it.
            gc.collect()
            free_device_cache(self.device)
            if max(sizes) == 1:
                raise OutOfMemoryAtOneRow(kind, failure)
            self.rows[kind] = max(sizes) // 2  # from the size that failed, which a plan can keep below `rows`
            self.counts[f"{kind}_oom"] += 1
            log.warning("out of memory in %s of %d rows: retrying at %d", named(kind), max(sizes), self.rows[kind])
