"""`python -m miniverl.bench`."""

from __future__ import annotations

import sys

from miniverl.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
