"""One field rule (`Rule`), its shorthand constructors and the notes several rules share."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from miniverl.config.model import ToyArchitecture
from miniverl.verl_compat.defaults import ROLLOUT, TEACHER

STATUSES = ("mapped", "derived", "fixed_in_verl", "no_verl_equivalent", "not_applicable")


@dataclass(frozen=True)
class Rule:
    field: str
    status: str
    verl_keys: tuple[str, ...] = ()
    transform: str = ""
    note: str = ""
    verl_value: Any = None  # fixed_in_verl: the one value verl v0.8.0 runs with

    def as_dict(self) -> dict:
        out = {
            "field": self.field,
            "status": self.status,
            "verl_keys": list(self.verl_keys),
            "transform": self.transform,
            "note": self.note,
        }
        if self.status == "fixed_in_verl":
            out["verl_value"] = self.verl_value
        return out


def mapped(fieldname: str, *keys: str, transform: str = "identity", note: str = "") -> Rule:
    return Rule(fieldname, "mapped", tuple(keys), transform, note)


def not_applicable(fieldname: str, note: str) -> Rule:
    return Rule(fieldname, "not_applicable", note=note)


def no_equivalent(fieldname: str, note: str) -> Rule:
    return Rule(fieldname, "no_verl_equivalent", note=note)


TOY_FIELDS = tuple(f.name for f in fields(ToyArchitecture))
TOY_NOTE = "the toy architecture is built inside miniverl; verl loads Hugging Face models only"
MAX_LEN_KEYS = (f"{ROLLOUT}.max_model_len", f"{TEACHER}.inference.max_model_len")
MAX_LEN_TRANSFORM = "max_model_len = recipe.prompt_limit + recipe.response_limit + 1 (student rollout and teacher)"
