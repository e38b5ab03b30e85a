"""Range checks of the numeric keys, one wording for every schema: `<key>=<value> must be <bounds>:
<why>`, raised while the composed config is converted (`to_config`), before any folder or model is
written — a negative learning rate is refused here, not by torch three files later."""

from __future__ import annotations

import math


def check_range(
    key: str,
    value: float | None,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
    null_ok: bool = False,
    why: str = "",
) -> None:
    """Refuse `value` of config key `key` (its full dotted path) outside the given bounds, NaN and
    infinities included; None passes only with `null_ok`."""
    if value is None and null_ok:
        return
    bounds = [
        (f"> {above}", lambda v: v > above) if above is not None else None,
        (f">= {at_least}", lambda v: v >= at_least) if at_least is not None else None,
        (f"< {below}", lambda v: v < below) if below is not None else None,
        (f"<= {at_most}", lambda v: v <= at_most) if at_most is not None else None,
    ]
    bounds = [b for b in bounds if b is not None]
    if value is not None and math.isfinite(value) and all(holds(value) for _, holds in bounds):
        return
    wanted = " and ".join(text for text, _ in bounds) or "a finite number"
    if bounds and value is not None and not math.isfinite(value):
        wanted = f"a finite number {wanted}"
    raise ValueError(f"{key}={value} must be {wanted}{' (or null)' if null_ok else ''}" + (f": {why}" if why else ""))
