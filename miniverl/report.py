"""`python -m miniverl.report compare A B` (report.json files or run folders): two run reports side
by side — every measurement with both values and B/A, whether the two trained alike bit for bit,
every identity field that differs, the settings that differ (plan.json's, beside each report:
the config fields that shape a run) and the other config keys that differ (resolved_config.yaml's).

Named after its command, `python -m miniverl.report`; report.json is built by
miniverl/trainer/run_report.py and rendered as report.md by miniverl/trainer/report_page.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from miniverl import __version__
from miniverl.utils.run_names import PLAN, REPORT, REPORT_SCHEMA_VERSION, RESOLVED_CONFIG
from miniverl.utils.tables import flatten, format_value

IGNORED = ("measured_at",)
# Hashes of files that record the updates' timings (state.json keeps each update's timing_s/*): two runs
# that computed alike bit for bit, a resume and its uninterrupted twin, still differ here, so these are
# named apart from the identity fields; the tensors' hashes say whether the runs computed alike.
TIMED_FILE_HASHES = ("artifacts.checkpoint_hashes.state.json",)


def is_measurement(key: str) -> bool:
    return key.startswith("measurements.") or key in (
        "resume.resume_load_seconds",
        "resume.interrupt_checkpoint_bytes",
        "artifacts.total_workload_bytes",
        "resource_contract.total_gpu_workload_seconds",
        "resource_contract.total_workload_seconds",
    )


def compare(
    a: dict, b: dict, settings: tuple[dict, dict] | None = None, configs: tuple[dict, dict] | None = None
) -> list[str]:
    """Lines of the side-by-side comparison: every measurement with both values and b/a, then every
    identity field that differs; with `settings` (each run's plan.json settings) the ones that differ,
    which say what the identity fields' digests do not: what was changed; with `configs` (each run's
    resolved_config.yaml) the other keys that differ, which the plan leaves out (eval.*: the probe)."""
    fa, fb = flatten(a), flatten(b)
    keys = sorted(set(fa) | set(fb))
    width = max((len(k) for k in keys), default=10)
    lines = [f"{'measurement':<{width}}  {'A':>14}  {'B':>14}  {'B/A':>8}"]
    for key in (k for k in keys if is_measurement(k)):
        va, vb = fa.get(key), fb.get(key)
        ratio = f"{vb / va:.3f}" if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else "-"
        lines.append(f"{key:<{width}}  {format_value(va):>14}  {format_value(vb):>14}  {ratio:>8}")
    differing = [k for k in keys if not is_measurement(k) and k not in IGNORED and fa.get(k) != fb.get(k)]
    timed = [k for k in differing if k in TIMED_FILE_HASHES]
    differing = [k for k in differing if k not in TIMED_FILE_HASHES]
    lines += ["", training_verdict(fa, fb), ""]
    lines.append(f"identity fields that differ: {len(differing)}")
    lines += [f"  {k}: {format_value(fa.get(k))} | {format_value(fb.get(k))}" for k in differing]
    lines += [f"  (also {k}: the file records each update's timings, which differ between any two runs)" for k in timed]
    if settings is not None:
        sa, sb = (flatten(one) for one in settings)
        changed = sorted(k for k in set(sa) | set(sb) if sa.get(k) != sb.get(k))
        lines += ["", f"settings that differ (plan.json): {len(changed)}"]
        lines += [f"  {k}: {format_value(sa.get(k))} | {format_value(sb.get(k))}" for k in changed]
    if configs is not None:
        ca, cb = (flatten(one) for one in configs)
        planned = set(flatten(settings[0])) | set(flatten(settings[1])) if settings is not None else set()
        other = sorted(k for k in set(ca) | set(cb) if k not in planned and ca.get(k) != cb.get(k))
        lines += ["", f"other config that differs (resolved_config.yaml, outside the plan): {len(other)}"]
        lines += [f"  {k}: {format_value(ca.get(k))} | {format_value(cb.get(k))}" for k in other]
    return lines


# What two runs trained, bit for bit: every update's sampled tokens and scores, and the adapter they left.
TRAINING_DIGESTS = ("artifacts.trajectory_sha256", "artifacts.standard_peft_adapter_sha256")


def training_verdict(fa: dict, fb: dict) -> str:
    """One line: whether two flattened reports' runs trained alike, by their trajectories' and adapters' digests
    (a byte-exact resume and its uninterrupted twin do; the timings and the clock never do)."""
    if any(fa.get(key) is None or fb.get(key) is None for key in TRAINING_DIGESTS):
        return "training: not compared (a report lacks trajectory_sha256 or the adapter's sha256)"
    differ = [key.split(".", 1)[1] for key in TRAINING_DIGESTS if fa[key] != fb[key]]
    if not differ:
        return "training: the same, bit for bit (trajectory_sha256 and standard_peft_adapter_sha256 are equal)"
    return f"training: differs ({' and '.join(differ)} differ{'s' if len(differ) == 1 else ''})"


def plan_settings(report_path: Path) -> dict | None:
    """The settings of the plan.json beside a report (None: not there, e.g. a report copied alone)."""
    try:
        return json.loads((report_path.parent / PLAN).read_text(encoding="utf-8"))["settings"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resolved_config_beside(report_path: Path) -> dict | None:
    """The resolved_config.yaml beside a report (None: not there or not readable)."""
    import yaml

    try:
        config = yaml.safe_load((report_path.parent / RESOLVED_CONFIG).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    return config if isinstance(config, dict) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miniverl.report", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cmp_parser = sub.add_parser("compare", help="two reports side by side", description=__doc__.split("\n\n")[0])
    cmp_parser.add_argument("a", type=Path, metavar="A", help="a report.json, or the run folder that holds one")
    cmp_parser.add_argument("b", type=Path, metavar="B", help="the report to compare with A (B/A in the table)")
    args = parser.parse_args(argv)
    reports, settings, configs = [], [], []
    paths = [path / REPORT if path.is_dir() else path for path in (args.a, args.b)]  # a run folder: its report
    for path in paths:
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            print(f"miniverl: error: {path}: not a readable report ({error})", file=sys.stderr)
            return 2
        if not isinstance(report, dict) or "schema_version" not in report:
            line = f"{path}: not a miniverl report (no schema_version); give a run's report.json or its folder"
            print(f"miniverl: error: {line}", file=sys.stderr)
            return 2
        if report["schema_version"] != REPORT_SCHEMA_VERSION:
            line = (
                f"{path}: a report of schema_version {report['schema_version']!r}; this miniverl "
                f"({__version__}) reads schema_version {REPORT_SCHEMA_VERSION}: compare with the release that wrote it"
            )
            print(f"miniverl: error: {line}", file=sys.stderr)
            return 2
        reports.append(report)
        settings.append(plan_settings(path))
        configs.append(resolved_config_beside(path))
    print(f"A: {args.a}\nB: {args.b}")
    if paths[0].resolve() == paths[1].resolve():  # a slip for two runs: every ratio would be 1
        print("note: A and B are the same report")
    both = {
        name: None if None in pair else tuple(pair) for name, pair in (("settings", settings), ("configs", configs))
    }
    print("\n".join(compare(*reports, **both)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
