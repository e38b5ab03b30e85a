"""`python -m miniverl.import_verl FILE [-o OUT]`: a verl v0.8.0 launch read back into miniverl
overrides (miniverl/verl_compat/import_verl.py says what it reads and writes)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from miniverl.utils.errors import MiniverlError, exit_code_of
from miniverl.verl_compat.import_verl import __doc__ as what
from miniverl.verl_compat.import_verl import import_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miniverl.import_verl", description=what.split("\n\n")[0])
    parser.add_argument("file", help="a verl launch script (run_*.sh) or an overrides file (one per line)")
    parser.add_argument("-o", "--output", help="write the miniverl overrides here (default: stdout)")
    args = parser.parse_args(argv)
    try:
        text = import_file(args.file)
    except MiniverlError as error:
        return exit_code_of(error)
    if args.output:
        Path(args.output).write_text(text)
        print(f"miniverl overrides written to {args.output}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
