"""For the ablation scripts (docs/learning.md): the held-out probe keeps the shipped code, so every
run's held-out KL is measured on the same sample paths. A patched function asks `probing()`."""

from __future__ import annotations

import miniverl.trainer.validation as validation

_probing = False


def probing() -> bool:
    """True while the held-out probe measures."""
    return _probing


def _measure_with_the_shipped_code(self, shift):
    global _probing
    _probing = True
    try:
        return _shipped_measure(self, shift)
    finally:
        _probing = False


_shipped_measure = validation.ValidationProbe.measure
validation.ValidationProbe.measure = _measure_with_the_shipped_code
