"""Command line of the benchmark: ``python -m benchmarks.run [--size 1G] [--quick] ...``."""

from __future__ import annotations

import sys

from benchmarks.harness import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m benchmarks.run"))
