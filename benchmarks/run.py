"""The full benchmark run: ``python -m benchmarks.run [--size 1G] [--workloads abcdefghi] ...``.

The harness itself ships with the package (``memshare._tools.benchmarks``, also run
by ``python -m memshare bench``, quick by default); this entry point keeps the
full-run defaults: every workload, an array of min(1 GiB, RAM / 16, free
/dev/shm / 4). ``RESULTS.md`` next to it holds the measured figures.
"""

from __future__ import annotations

import sys

from memshare._tools.benchmarks.harness import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m benchmarks.run"))
