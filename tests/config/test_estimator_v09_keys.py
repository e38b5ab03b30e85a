"""The estimator keys verl v0.9 added: `loss_agg_mode: token-sum` and the chunked top-k pair,
composed from conf/estimator/ and validated when the config is converted."""

from __future__ import annotations

import pytest

from miniverl.config import to_config
from miniverl.config.estimator import LOSS_AGG_MODES, EstimatorConfig
from miniverl.utils.errors import MiniverlError

from conftest import compose_config


def test_chunked_topk_defaults_and_overrides_compose():
    est = to_config(compose_config(["+recipe=opd_k1", "estimator=forward_kl_topk"])).estimator
    assert (est.use_chunked_topk, est.chunked_topk_chunk_size) == (False, 4096)
    overrides = ["estimator.use_chunked_topk=true", "estimator.chunked_topk_chunk_size=7"]
    est = to_config(compose_config(["+recipe=opd_k1", "estimator=forward_kl_topk", *overrides])).estimator
    assert (est.use_chunked_topk, est.chunked_topk_chunk_size) == (True, 7)


def test_token_sum_composes():
    assert "token-sum" in LOSS_AGG_MODES
    config = to_config(compose_config(["+recipe=opd_k1", "estimator.loss_agg_mode=token-sum"]))
    assert config.estimator.loss_agg_mode == "token-sum"


@pytest.mark.parametrize("size", [0, -3])
def test_a_chunk_size_below_one_is_refused_in_one_line(size):
    overrides = ["+recipe=opd_k1", "estimator=forward_kl_topk", f"estimator.chunked_topk_chunk_size={size}"]
    with pytest.raises(MiniverlError) as info:
        to_config(compose_config(overrides))
    message = str(info.value)
    assert f"estimator.chunked_topk_chunk_size={size} must be >= 1" in message and "\n" not in message


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"chunked_topk_chunk_size": 2.5}, "chunked_topk_chunk_size=2.5 must be an integer"),
        ({"chunked_topk_chunk_size": True}, "chunked_topk_chunk_size=True must be an integer"),
        ({"use_chunked_topk": "yes"}, "use_chunked_topk='yes' must be true or false"),
    ],
)
def test_wrong_types_are_refused_by_the_schema(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        EstimatorConfig(loss_mode="forward_kl_topk", **kwargs)
