"""`python -m miniverl.conformance FILE [--dtype float64|float32] [--rtol R]`: miniverl's losses
(and its task advantages and rewards) against golden vectors computed by verl's own functions, of the
release FILE names (`verl_version`; v0.8.0 for files without one). miniverl/verl_compat/conformance.py
says what is checked; exit 0 when everything matches, 1 on a mismatch, 2 when FILE cannot be read."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from miniverl.utils.errors import MiniverlError, exit_code_of
from miniverl.verl_compat.conformance import (
    DEFAULT_RTOL,
    SCALE_FLOOR,
    check_case,
    check_refused,
    check_warned,
    describe,
    describe_config,
    export_only,
    golden_version,
    rtol_kind,
)

PROG = "miniverl.conformance"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description="miniverl's losses, task advantages and rewards (miniverl/workers/) against golden vectors "
        "computed by verl's own functions, of the release the file names.",
    )
    parser.add_argument("file", help="golden JSON file, e.g. tests/data/verl-0.8.0-opd-loss.json")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64", help="compute dtype")
    parser.add_argument(
        "--rtol", type=float, default=None, help="relative tolerance for every case (default: per dtype and kind)"
    )
    args = parser.parse_args(argv)
    if args.rtol is not None and not args.rtol >= 0:  # a negative or NaN tolerance fails every case
        parser.error(f"--rtol {args.rtol}: give a tolerance of 0 or more")
    golden = "the golden files are tests/data/verl-*.json"

    try:
        with open(args.file, encoding="utf-8") as fh:
            data = json.load(fh)
        cases = data["cases"]
        if not isinstance(cases, list):
            raise TypeError("'cases' is not a list")
        version = golden_version(data)
    except OSError as exc:
        return exit_code_of(MiniverlError(f"cannot read {args.file}: {exc.strerror or exc}; {golden}"), PROG)
    except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
        what = f"{args.file} is not a golden-vector file: {type(exc).__name__}: {exc}; {golden}"
        return exit_code_of(MiniverlError(what), PROG)

    dtype = getattr(torch, args.dtype)
    n_match = 0
    for i, case in enumerate(cases):
        kind = case.get("kind") if isinstance(case, dict) else None
        rtol = args.rtol if args.rtol is not None else DEFAULT_RTOL[args.dtype].get(rtol_kind(kind), 1e-9)
        if isinstance(case, dict):
            label, problems = describe(case), check_case(case, dtype, rtol, SCALE_FLOOR[args.dtype], version)
        else:
            label, problems = "?", ["not an object"]
        for problem in problems:
            print(f"case {i} ({label}): {problem}")
        n_match += not problems

    ok = n_match == len(cases)
    counts, n_export = {}, 0
    for kind, check in (("refused", check_refused), ("warned", check_warned)):
        entries = data.get(kind, [])
        checked = [entry for entry in entries if not export_only(entry)]
        counts[kind] = (0, len(checked))
        for i, entry in enumerate(entries):
            if export_only(entry):  # verl changed its answer between releases: the export enforces it
                n_export += 1
                why = export_only(entry)
                print(f"{kind} {i} ({describe_config(entry)}): left to the export to verl {version}: {why}")
                continue
            good, msg = check(entry)
            counts[kind] = (counts[kind][0] + good, len(checked))
            print(f"{kind} {i} ({describe_config(entry)}): {'ok, ' if good else 'MISMATCH: '}{msg}")
    (n_refused, n_ref_total), (n_warned, n_warn_total) = counts["refused"], counts["warned"]
    ok = ok and n_refused == n_ref_total and n_warned == n_warn_total
    if n_ref_total or n_warn_total:  # the task-reward file has no configurations to refuse
        left = f"; {n_export} left to the export (verl changed them between releases)" if n_export else ""
        print(f"refused: {n_refused}/{n_ref_total} configurations refused as in verl; "
              f"warned: {n_warned}/{n_warn_total} accepted with a warning{left}")  # fmt: skip
    print(f"conformance: {n_match}/{len(cases)} cases match verl {version}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
