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

from .benchmarks.runners import CONTENDERS

_DEFAULT_BYTES = 256 * 1024**2
# Inputs (a), results (c), tiny tasks (d), the shared-array loop (i), a string[pyarrow] DataFrame (j) and a large
# dict (l): what memshare changes for each kind of data, in under 4 minutes on 2 cores with 3 repeats (2 min 20 s
# at load average 3.3). The others repeat what these show or take longer: whole scans (b: the pickling contenders
# pickle the whole array per task), the managed and the Arrow second calls (e, n), the shared array in a loop (f,
# which (i) covers), GridSearchCV (g), the n_jobs sweep (h), the Arrow variants (k, m), the pools on small items
# (p) and the tasks that return their input (q, r: the pickling contenders send each result back whole): ask for
# them with --workloads.
DEFAULT_WORKLOADS = "acdijl"
# joblib without memmapping pickles like mp.Pool, which stays as the standard library's pool: ask for it with
# --contenders.
DEFAULT_CONTENDERS = tuple(c for c in CONTENDERS if c != "joblib-nomemmap")


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m memshare bench") -> int:
    """Run the benchmark with command-line options ``argv`` (see ``--help``); return the exit code.

    Without ``--size``/``--quick`` the array is 256 MiB (or less on a small
    machine), without ``--workloads`` and ``--contenders`` the main
    workloads and contenders run, 3 repeats each: under 4 minutes on 2 cores.
    """
    from .benchmarks import harness, machine

    return harness.main(
        list(sys.argv[2:] if argv is None else argv),
        prog=prog,
        command=prog,
        default_workloads=DEFAULT_WORKLOADS,
        default_size=min(_DEFAULT_BYTES, machine.default_size()),
        default_contenders=DEFAULT_CONTENDERS,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
