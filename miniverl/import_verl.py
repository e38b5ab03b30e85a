"""`python -m miniverl.import_verl FILE [-o OUT] [--verl-version V]`: a verl launch read back into
miniverl overrides (miniverl/verl_compat/import_verl.py says what it reads and writes)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from miniverl.utils.errors import MiniverlError, exit_code_of
from miniverl.verl_compat.import_verl import __doc__ as what
from miniverl.verl_compat.import_verl import import_file
from miniverl.verl_compat.launch_reader import release_note
from miniverl.verl_compat.versions import EXPORT_DEFAULT, RELEASES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miniverl.import_verl", description=what.split("\n\n")[0])
    parser.add_argument("file", help="a verl launch script (run_*.sh) or an overrides file (one per line)")
    parser.add_argument(
        "-o", "--output", help="write the miniverl overrides to this new file (default: stdout); never replaces another"
    )
    parser.add_argument(
        "--verl-version",
        choices=tuple(RELEASES),
        default=None,
        help="the verl release of the launch: its defaults fill what it leaves out (default: the release "
        f"miniverl's export wrote it for, else {EXPORT_DEFAULT})",
    )
    args = parser.parse_args(argv)
    if args.output and Path(args.output).is_dir():
        return exit_code_of(MiniverlError(f"-o {args.output} is a folder; give the file to write the overrides to"))
    try:
        text = import_file(args.file, version=args.verl_version)
    except MiniverlError as error:
        return exit_code_of(error)
    if note := release_note(args.file, args.verl_version):  # also in the text, as a comment
        print(f"miniverl: warning: {note}", file=sys.stderr)
    if args.output:
        out = Path(args.output)
        try:
            if out.is_file() and out.read_bytes() != text.encode():  # the same import again is no replacement
                return exit_code_of(
                    MiniverlError(f"-o {out} exists and holds other text; choose another -o, or remove it first")
                )
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
        except OSError as error:  # whatever the reason (read-only, full, /proc): the one line, the same fix
            where = error.filename or args.output
            return exit_code_of(MiniverlError(f"cannot write {where}: {error.strerror}; choose another -o"))
        print(f"miniverl overrides written to {args.output}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
