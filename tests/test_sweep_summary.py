"""The sweep summary's plot: every job visible, even where two jobs' losses are equal."""

from __future__ import annotations

import matplotlib.image

from miniverl import sweep_summary


def job(number: int, swept: str, losses: list[float]) -> tuple[dict, list[float]]:
    return {"job": str(number), "swept": swept, "status": "measured"}, losses


def test_a_job_whose_curve_equals_an_earlier_ones_says_so_in_the_legend(tmp_path):
    # A sweep over model.lora.r=8,16 on k1 and k3: r does not change the toy's first updates' losses.
    jobs = [
        job(0, "estimator=k1 model.lora.r=8", [2.0, 1.5]),
        job(1, "estimator=k1 model.lora.r=16", [2.0, 1.5]),
        job(2, "estimator=k3 model.lora.r=8", [0.4, 0.3]),
        job(3, "estimator=k3 model.lora.r=16", [0.4, 0.3]),
    ]
    assert sweep_summary.legend_labels(jobs) == [
        "#0 estimator=k1 model.lora.r=8",
        "#1 estimator=k1 model.lora.r=16 (the same curve as #0)",
        "#2 estimator=k3 model.lora.r=8",
        "#3 estimator=k3 model.lora.r=16 (the same curve as #2)",
    ]
    sweep_summary.plot(jobs, tmp_path / "sweep_summary.png")
    assert matplotlib.image.imread(str(tmp_path / "sweep_summary.png")).shape[:2] == (450, 800)
