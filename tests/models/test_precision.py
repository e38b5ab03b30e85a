"""How closely two computations of the same log-probs must agree: the verdicts of the doctor's
self-test (models/precision.py)."""

from __future__ import annotations

import pytest
import torch

from miniverl.models import precision

TOKENS = 192  # the real recipe's self-test: 4 rows x 48 tokens


def verdict(dtype, *off):
    """The verdict when every token agrees to 1e-6 but the ones given, (position, difference)."""
    k1 = torch.full((4, 48), 1e-6)
    for position, difference in off:
        k1.view(-1)[position] = difference
    return precision.agreement(k1, torch.ones(4, 48), dtype)


def test_rounding_within_the_tolerance_passes():
    assert verdict(torch.bfloat16, (0, 0.4))[0] == "PASS" and verdict(torch.float32, (0, 9e-4))[0] == "PASS"


def test_a_few_bf16_tokens_in_roundings_tail_warn_and_say_how_to_tell():
    status, line = verdict(torch.bfloat16, (5, 0.75), (70, -0.6))  # the 20-layer real cut's worst: 0.75
    assert status == "WARN"
    assert line.endswith(
        "2 of 192 tokens over the largest, the mean within: rounding's tail on some trained models; to tell it "
        "from a path that differs, run again with model.dtype=float32"
    )


@pytest.mark.parametrize(
    "dtype,off",
    [
        (torch.float32, [(0, 2e-3)]),  # float32 paths agree to ~1e-5: any token over is a path that differs
        (torch.bfloat16, [(0, 1.2)]),  # over twice the largest: more than rounding reaches
        (torch.bfloat16, [(position, 0.3) for position in range(0, TOKENS, 2)]),  # the mean: at half the tokens
        (torch.bfloat16, [(47, 4.0)]),  # one misaligned position per row would be several nats
    ],
)
def test_a_path_that_differs_fails(dtype, off):
    status, line = verdict(dtype, *off)
    assert status == "FAIL" and line.endswith("sampling and scoring disagree (alignment or a numerical path differs)")


def test_a_difference_that_is_not_finite_fails_and_padding_is_no_difference():
    k1, mask = torch.full((2, 4), 1e-6), torch.ones(2, 4)
    k1[1, 3], mask[1, 3] = float("nan"), 0.0  # padding: -inf - -inf
    assert precision.agreement(k1, mask, torch.bfloat16)[0] == "PASS"
    k1[0, 0] = float("nan")  # a NaN compares False with every tolerance: it once passed
    assert precision.agreement(k1, mask, torch.bfloat16) == ("FAIL", "1 of 7 log-prob differences are not finite")
