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


def test_the_page_headline_says_what_the_student_learned_where_the_loss_cannot():
    """A new-user audit: report.md's headline was the final loss alone, -0.0020628 (a centred policy gradient:
    ~0 by construction), with the held-out KL the console prints only in a raw table further down."""
    from miniverl.trainer.report_page import markdown

    report = {
        "profile": "p",
        "status": "measured",
        "resume": {"status": "not_checked"},
        "recipe": {"optimizer_updates": 4, "estimator": "k1", "advantage_baseline": "batch_mean"},
        "distillation_progress": {
            "exact_reverse_kl": [{"update": 0, "value": 2.279}, {"update": 4, "value": 1.842}],
            "k1_mean": [{"update": 0, "value": 3.1}, {"update": 4, "value": 2.0}],
        },
    }
    head = markdown(report, history(4, False)).split("![curves]", 1)[0]
    assert "Final distillation loss (actor/distillation/loss): **1** (~0 by construction with " in head
    assert "Held-out: 2.279 at update 0 -> 1.842 at update 4 (exact reverse KL" in head
    plain = markdown({**report, "recipe": {**report["recipe"], "advantage_baseline": "none"}}, history(4, False))
    assert "by construction" not in plain


def test_the_page_headline_takes_the_last_updates_loss_and_task_score():
    """(a tests audit: every test history held one value throughout, so the first update's passed for the last)"""
    from miniverl.trainer.report_page import markdown

    report = {"profile": "p", "status": "measured", "resume": {"status": "not_checked"}}
    report["recipe"] = {"optimizer_updates": 2, "estimator": "k1", "advantage_baseline": "none"}
    updates = [
        {"actor/distillation/loss": 1.5, "critic/score/mean": 0.1},
        {"actor/distillation/loss": 0.25, "critic/score/mean": 0.9},
    ]
    head = markdown(report, updates).split("![curves]", 1)[0]
    assert "Final distillation loss (actor/distillation/loss): **0.25**." in head
    assert "Task score (critic/score/mean) at the last update: **0.9**." in head
