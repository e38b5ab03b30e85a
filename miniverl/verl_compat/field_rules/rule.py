"""One field rule (`Rule`), its shorthand constructors and the notes several rules share."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
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
    verl_value: Any = None  # fixed_in_verl: the one value verl runs with
    # The first verl release with these keys (None: every release miniverl exports to). For an older
    # release the rule reads as no_verl_equivalent (`for_release`), and `older_value` is the value that
    # means what the older release does (None: any value does); the export refuses another.
    since: str | None = None
    older_value: Any = None
    # Keys a later release added that mean the same field, beside verl_keys: (verl key, first release with it).
    later_keys: tuple[tuple[str, str], ...] = ()

    def for_release(self, version: str) -> Rule:
        """This rule as `version` reads it: itself with the later keys that release has, or for a release
        older than `since`, no equivalent."""
        if self.since is None or _release_key(version) >= _release_key(self.since):
            had = tuple(key for key, since in self.later_keys if _release_key(version) >= _release_key(since))
            return replace(self, verl_keys=self.verl_keys + had, later_keys=()) if self.later_keys else self
        keys = ", ".join(self.verl_keys)
        older = self.older_value
        value = "" if older is None else f"; the export for it refuses a value other than {older!r}"
        note = f"verl {version} has no {keys} (new in verl {self.since}){value}"
        return Rule(self.field, "no_verl_equivalent", note=note, since=self.since, older_value=self.older_value)

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
        if self.since is not None:
            out["since"] = self.since
        return out


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def mapped(
    fieldname: str, *keys: str, transform: str = "identity", note: str = "", since: str | None = None,
    older_value: Any = None, later_keys: tuple[tuple[str, str], ...] = (),
) -> Rule:  # fmt: skip
    return Rule(
        fieldname, "mapped", tuple(keys), transform, note, since=since, older_value=older_value, later_keys=later_keys
    )


def not_applicable(fieldname: str, note: str) -> Rule:
    return Rule(fieldname, "not_applicable", note=note)


def no_equivalent(fieldname: str, note: str) -> Rule:
    return Rule(fieldname, "no_verl_equivalent", note=note)


TOY_FIELDS = tuple(f.name for f in fields(ToyArchitecture))
TOY_NOTE = "the toy architecture is built inside miniverl; verl loads Hugging Face models only"
MAX_LEN_KEYS = (f"{ROLLOUT}.max_model_len", f"{TEACHER}.inference.max_model_len")
MAX_LEN_TRANSFORM = "max_model_len = recipe.prompt_limit + recipe.response_limit + 1 (student rollout and teacher)"
