"""``python -m memshare bench``: memshare against joblib, quick by default.

The harness ships with the package (``memshare._tools.benchmarks``), so the command
works from any folder after a plain ``pip install``; ``benchmarks/run.py`` in
the repository is the full-run entry point over the same harness. Its optional
dependencies (matplotlib for ``--plot`` and the default run's picture,
scikit-learn for workload g) come with the ``bench`` extra: what ``--plot`` and
workload g need is checked before anything runs; without matplotlib the run
writes no picture and says how to get one. Workloads j, k, m and n need pandas and
pyarrow, and r needs torch: each is skipped (with a note saying so) where they
are missing.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

_DEFAULT_BYTES = 256 * 1024**2
# Inputs, whole scans, results, tiny tasks, a managed second call, the shared-array loop, a string[pyarrow]
# DataFrame (j) and a second call over it (n), a large dict (l), the pools on small items (p) and tasks that
# return their input, an array (q) and a torch tensor (r, where torch is installed). The shared
# array in a loop (f, which (i) covers), GridSearchCV (g), the n_jobs sweep (h), and the Arrow variants (k: Arrow
# dtypes from Parquet, m: Arrow results) take longer or repeat what the others show: ask for them with --workloads.
DEFAULT_WORKLOADS = "abcdeijlnpqr"


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m memshare bench") -> int:
    """Run the benchmark with command-line options ``argv`` (see ``--help``); return the exit code.

    Without ``--size``/``--quick`` the array is 256 MiB (or less on a small
    machine) and without ``--workloads`` the main workloads run, so the
    default run takes a few minutes.
    """
    from .benchmarks import harness, machine

    return harness.main(
        list(sys.argv[2:] if argv is None else argv),
        prog=prog,
        command=prog,
        default_workloads=DEFAULT_WORKLOADS,
        default_size=min(_DEFAULT_BYTES, machine.default_size()),
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
