"""Report values as table text: floats to a number of significant digits, whole numbers past them
written out rather than in scientific notation."""

from __future__ import annotations

import pytest

from miniverl.utils.tables import flatten, format_value


@pytest.mark.parametrize(
    "value,digits,text",
    [
        (55870.3, 4, "55870"),  # a throughput: not 5.587e+04
        (1234.5678, 4, "1235"),
        (9999.7, 4, "10000"),  # rounds up past the digits: still written out
        (0.000123456, 4, "0.0001235"),
        (1.0, 6, "1"),
        (None, 6, "null"),
        ([1, 2], 6, "[1, 2]"),
        (float("inf"), 4, "inf"),
    ],
)
def test_a_value_is_written_to_its_digits_without_scientific_notation_for_large_ones(value, digits, text):
    assert format_value(value, digits=digits) == text


def test_flatten_joins_nested_keys_with_dots_and_keeps_an_empty_dict_as_a_leaf():
    assert flatten({"a": {"b": 1, "c": {}}, "d": 2}) == {"a.b": 1, "a.c": {}, "d": 2}
