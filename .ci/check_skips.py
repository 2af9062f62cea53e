"""Fail when the suite skipped a test that should have run in this CI environment.

Usage: python .ci/check_skips.py ENVIRONMENT JUNIT_XML   (pytest --junitxml=JUNIT_XML)

CI runs as root, on Linux, with a C compiler, /dev/shm and the test extras: there
every test can run, the ones that mount a tmpfs, act as another user or need the C
helper included. A skip there means a test quietly stopped testing anything, so
every skip fails the check unless ALLOWED lists it for that environment, with why.
Exit status: 0 when every skip is allowed, 1 otherwise (or when the report is missing).
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ElementTree
from typing import List, NamedTuple, Tuple

ENVIRONMENTS = ("main", "py3.15", "py3.14", "debian3.11", "py3.13", "py3.12", "oldest")


class Allowed(NamedTuple):
    """Skips of tests matching ``test`` whose reason matches ``reason`` are expected in ``environments``."""

    environments: Tuple[str, ...]
    test: str  # a regular expression searched in "module::test"
    reason: str  # a regular expression searched in the skip's reason
    why: str


ALLOWED = (
    Allowed(
        ("py3.15", "py3.14", "py3.13", "py3.12", "oldest"),
        # test_torch, and bench workload (r), which times torch tensors.
        r"^tests\.(test_torch|test_bench_workloads::test_tasks_returning_their_input\w*\[r\])",
        r"torch",
        "torch==2.13.0 installs a CPU build from this machine's disk for Python 3.11 on x86_64 only (setup.py's"
        " marker); elsewhere pip would download a CUDA build of several GB",
    ),
    Allowed(
        ("oldest",),
        r"^tests\.test_backend::test_generator_unordered",
        r"needs joblib>=1\.4",
        "joblib 1.3 (setup.py's lower bound) has no return_as='generator_unordered'",
    ),
    Allowed(
        ("oldest", "py3.12"),
        r"^tests\.test_backend_initializer::",
        r"joblib\.Parallel takes initializer= from joblib 1\.5 on",
        "joblib.Parallel takes initializer= from joblib 1.5 on; parallel_config's is tested in every version",
    ),
    Allowed(
        ("oldest",),
        r"^tests\.test_buffers::",
        r"does not store strings in Arrow by default",
        "pandas 1.5 stores strings as Python objects; from pandas 3 they are in Arrow by default",
    ),
)


class Skip(NamedTuple):
    test: str
    reason: str


def skips(report: str) -> List[Skip]:
    """The skipped tests of a JUnit XML report; a module skipped whole counts as one, named after the module."""
    found = []
    for case in ElementTree.parse(report).iter("testcase"):
        skipped = case.find("skipped")
        if skipped is None:
            continue
        classname, name = case.get("classname", ""), case.get("name", "")
        test = f"{classname}::{name}" if classname else name
        # A collection skip says only "collection skipped"; its reason is in the text.
        reason = skipped.get("message", "")
        if reason == "collection skipped":
            reason = skipped.text or reason
        found.append(Skip(test, reason))
    return found


def allowed_by(skip: Skip, environment: str) -> List[Allowed]:
    return [
        rule
        for rule in ALLOWED
        if environment in rule.environments and re.search(rule.test, skip.test) and re.search(rule.reason, skip.reason)
    ]


def main(argv: List[str]) -> int:
    if len(argv) != 2 or argv[0] not in ENVIRONMENTS:
        print(f"usage: check_skips.py {{{','.join(ENVIRONMENTS)}}} JUNIT_XML", file=sys.stderr)
        return 2
    environment, report = argv
    try:
        found = skips(report)
    except (OSError, ElementTree.ParseError) as exc:
        print(f"  skips: no readable pytest report ({exc})")
        return 1
    unexpected = [skip for skip in found if not allowed_by(skip, environment)]
    used = {rule for skip in found for rule in allowed_by(skip, environment)}
    for rule in used:
        count = sum(1 for skip in found if rule in allowed_by(skip, environment))
        print(f"  skips: {count} allowed here: {rule.why}")
    for rule in ALLOWED:
        if environment in rule.environments and rule not in used:
            print(f"  skips: note: an allowed skip did not happen here ({rule.test}): {rule.why}")
    if unexpected:
        print(f"  skips: {len(unexpected)} test(s) skipped that must run in {environment} (root, with a compiler):")
        for skip in unexpected:
            print(f"    {skip.test}: {skip.reason}")
        print("  (if a skip is right in this environment, add it to ALLOWED in .ci/check_skips.py, saying why)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
