"""What holding an array once costs the parent's own writes, and the next call after them.

An array held once is a private mapping of its shared file: the first write
to each page after it was sent copies that page, a page fault per 4 KiB.
This times ``x *= 2`` over a whole array of ordinary memory and over the
same array held once, then what the next call does with the changed array
(it moves to a new file: the whole array is copied), and the same after a
change of one element, alternating in each repeat. Sending an ordinary
array instead costs a full dump at every call.

Usage (from the repository root)::

    python -m benchmarks.held_writes --size-mib 1024 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from memshare._parent import _held_once


def _timed_doubling(array: np.ndarray) -> float:
    started = time.perf_counter()
    array *= 2.0
    return time.perf_counter() - started


def _timed_refresh(array: np.ndarray) -> float:
    record = _held_once.lookup(array)
    started = time.perf_counter()
    record.refresh(array)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    n = options.size_mib * 2**20 // 8
    times = {
        "ordinary: x *= 2": [],
        "held once: x *= 2": [],
        "held once: next call after x *= 2": [],
        "held once: next call after one element changed": [],
    }
    for _ in range(options.repeats):
        plain = np.ones(n)
        plain *= 1.0  # every page present, as in a program that built the array
        times["ordinary: x *= 2"].append(_timed_doubling(plain))
        del plain
        held = np.ones(n)
        held *= 1.0
        _held_once.hold(held)
        times["held once: x *= 2"].append(_timed_doubling(held))
        times["held once: next call after x *= 2"].append(_timed_refresh(held))
        held[n // 2] = -1.0
        times["held once: next call after one element changed"].append(_timed_refresh(held))
        del held
    base = statistics.median(times["ordinary: x *= 2"])
    print(f"| {options.size_mib} MiB of float64 | median | min-max | / ordinary x *= 2 |")
    print("|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} s | {min(values):.3f}-{max(values):.3f} s | {median / base:.1f} |")


if __name__ == "__main__":
    main()
