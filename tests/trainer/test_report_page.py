"""The report page: its curves' panels wrap into rows of three, whatever their number."""

from __future__ import annotations

import matplotlib.image
import pytest

from miniverl.trainer.report_page import plot_curves


def history(updates: int, task_score: bool) -> list[dict]:
    metrics = {"actor/distillation/loss": 1.0, "actor/grad_norm": 2.0, "response_length/mean": 8.0}
    if task_score:
        metrics["critic/score/mean"] = 0.5
    return [{**metrics, "training/global_step": u} for u in range(1, updates + 1)]


@pytest.mark.parametrize(
    "task_score,held_out,size",
    [
        (False, False, (320, 1080)),  # 3 panels: one row
        (True, True, (640, 1080)),  # 6 panels (task rewards, held-out KL and score): two rows of three
    ],
)
def test_the_curves_wrap_into_rows_of_three_panels(tmp_path, task_score, held_out, size):
    points = [{"update": 0, "value": 3.0}, {"update": 2, "value": 1.0}]
    progress = {"k1_mean": points, "exact_reverse_kl": points, "task_score": points} if held_out else None
    report = {"profile": "p", "status": "measured", "distillation_progress": progress}
    plot_curves(report, history(2, task_score), tmp_path / "curves.png")
    assert matplotlib.image.imread(str(tmp_path / "curves.png")).shape[:2] == size


def test_a_teacher_of_another_tokenizer_has_its_log_likelihood_per_character_drawn_beside_the_span_k1(tmp_path):
    """The cross-tokenizer recipe's second held-out measure (it dips before it rises) was left undrawn."""
    points = [{"update": 0, "value": 6.886}, {"update": 2, "value": 6.941}]
    loglik = [{"update": 0, "value": -2.55}, {"update": 2, "value": -2.635}]
    progress = {"k1_mean": points, "exact_reverse_kl": None, "teacher_loglik_per_char": loglik}
    report = {"profile": "p", "status": "measured", "distillation_progress": progress}
    plot_curves(report, history(2, False), tmp_path / "curves.png")
    assert matplotlib.image.imread(str(tmp_path / "curves.png")).shape[:2] == (640, 1080)  # 3 curves + 2 held-out
