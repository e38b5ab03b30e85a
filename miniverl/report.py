"""`python -m miniverl.report compare A B` (report.json files or run folders): two run reports side
by side — every measurement with both values and B/A, then every identity field that differs.

Named after its command, `python -m miniverl.report`; report.json is built by
miniverl/trainer/run_report.py and rendered as report.md by miniverl/trainer/report_page.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from miniverl.utils.tables import flatten, format_value

IGNORED = ("measured_at",)


def is_measurement(key: str) -> bool:
    return key.startswith("measurements.") or key in (
        "resume.resume_load_seconds",
        "resume.interrupt_checkpoint_bytes",
        "artifacts.total_workload_bytes",
        "resource_contract.total_gpu_workload_seconds",
        "resource_contract.total_workload_seconds",
    )


def compare(a: dict, b: dict) -> list[str]:
    """Lines of the side-by-side comparison: every measurement with both values and b/a, then every
    identity field that differs."""
    fa, fb = flatten(a), flatten(b)
    keys = sorted(set(fa) | set(fb))
    width = max((len(k) for k in keys), default=10)
    lines = [f"{'measurement':<{width}}  {'A':>14}  {'B':>14}  {'B/A':>8}"]
    for key in (k for k in keys if is_measurement(k)):
        va, vb = fa.get(key), fb.get(key)
        ratio = f"{vb / va:.3f}" if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else "-"
        lines.append(f"{key:<{width}}  {format_value(va):>14}  {format_value(vb):>14}  {ratio:>8}")
    differing = [k for k in keys if not is_measurement(k) and k not in IGNORED and fa.get(k) != fb.get(k)]
    lines.append("")
    lines.append(f"identity fields that differ: {len(differing)}")
    lines += [f"  {k}: {format_value(fa.get(k))} | {format_value(fb.get(k))}" for k in differing]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miniverl.report", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cmp_parser = sub.add_parser("compare", help="two reports side by side", description=__doc__.split("\n\n")[0])
    cmp_parser.add_argument("a", type=Path, metavar="A", help="a report.json, or the run folder that holds one")
    cmp_parser.add_argument("b", type=Path, metavar="B", help="the report to compare with A (B/A in the table)")
    args = parser.parse_args(argv)
    reports = []
    for path in (args.a, args.b):
        path = path / "report.json" if path.is_dir() else path  # a run folder: its report
        try:
            reports.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as error:
            print(f"miniverl: error: {path}: not a readable report ({error})", file=sys.stderr)
            return 2
    print(f"A: {args.a}\nB: {args.b}")
    print("\n".join(compare(*reports)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
