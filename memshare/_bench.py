"""``python -m memshare bench``: run the benchmark harness that lives in ``benchmarks/``.

The harness is not part of the installed package (it pulls in scikit-learn,
matplotlib and tqdm, and its results only make sense next to the sources it
measures), so this module only finds it: when ``memshare`` is imported from a
clone, ``benchmarks/`` sits next to the package directory and the repository
root is put on ``sys.path``. Otherwise it says how to get it.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

_NOT_FOUND = (
    "memshare bench: the benchmark harness (the 'benchmarks' package) was not found.\n"
    "It ships with the source repository, not with the installed package: clone the repository,\n"
    "install it (pip install -e .) and run 'python -m memshare bench' from the clone,\n"
    "or run 'python -m benchmarks.run' at its root."
)


_DEFAULT_BYTES = 256 * 1024**2
# Inputs, whole scans, results, tiny tasks, a managed second call, the shared-array loop.
# GridSearchCV (g) and the n_jobs sweep (h) take longer: ask for them with --workloads.
_DEFAULT_WORKLOADS = "abcdei"


def _repo_root() -> Optional[str]:
    """The directory holding both ``memshare/`` and ``benchmarks/``, if this is a clone."""
    package_dir = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(package_dir)
    if os.path.isfile(os.path.join(root, "benchmarks", "harness.py")):
        return root
    return None


def _load_harness():
    """Import ``benchmarks.harness``, adding the clone's root to ``sys.path`` if needed; None if absent."""
    root = _repo_root()
    if root is not None and root not in sys.path:
        sys.path.insert(0, root)
    try:
        from benchmarks import harness
    except ImportError:
        return None
    return harness


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark with command-line options ``argv`` (see ``--help``); return the exit code.

    Without ``--size``/``--quick`` the array is 256 MiB (or less on a small
    machine) and without ``--workloads`` the main workloads run, so the
    default run takes a few minutes.
    """
    harness = _load_harness()
    if harness is None:
        print(_NOT_FOUND, file=sys.stderr)
        return 2
    argv = list(sys.argv[2:] if argv is None else argv)
    if not any(arg.startswith(("--size", "--quick")) for arg in argv):
        # Quick by default (a few minutes): a quarter-size array; --size 1G for the full-size run.
        argv += ["--size", str(min(_DEFAULT_BYTES, harness.default_size()))]
    if not any(arg.startswith("--workloads") for arg in argv):
        argv += ["--workloads", _DEFAULT_WORKLOADS]
    return harness.main(argv, prog="python -m memshare bench", command="python -m memshare bench")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
