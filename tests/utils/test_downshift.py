"""The out-of-memory lines name the forward that ran out, in English."""

from miniverl.utils.downshift import OutOfMemoryAtOneRow, named


def test_a_forward_is_named_with_its_article():
    assert named("rollout") == "a rollout" and named("update_chunk") == "an update chunk"  # "a update_chunk" before
    assert str(OutOfMemoryAtOneRow("update_chunk", "CUDA out of memory")).startswith(
        "out of memory in an update chunk of a single row (CUDA out of memory); "
    )
