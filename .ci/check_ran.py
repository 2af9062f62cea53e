"""Fail when a test ran in no CI environment.

Usage: python .ci/check_ran.py COLLECTED JUNIT_XML...

COLLECTED is the main environment's ``pytest --collect-only -q`` output, one test id a line
(``tests/test_x.py::test_y[param]``); each JUNIT_XML is an environment's ``pytest --junitxml``
report. Environments other than main and the newest leave out the tests marked
``version_independent``, and any environment may skip a test (.ci/check_skips.py says where that
is allowed): a test that every environment left out or skipped tests nothing, so every test
collected in main, and every test any report lists, must have run (passed or failed) in at least
one report. A report that cannot be read counts as an environment where nothing ran.
Exit status: 0 when every test ran somewhere, 1 otherwise.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from typing import List, Set, Tuple


def node_id(classname: str, name: str) -> str:
    """JUnit's ``tests.test_x`` and ``test_y[p]`` as pytest's ``tests/test_x.py::test_y[p]`` (classes kept)."""
    parts = classname.split(".")
    # classname is the module's dotted path, then any test classes (capitalised by convention).
    for index, part in enumerate(parts):
        if part[:1].isupper():
            module, classes = parts[:index], parts[index:]
            break
    else:
        module, classes = parts, []
    return "::".join(["/".join(module) + ".py", *classes, name])


def cases(report: str) -> Tuple[Set[str], Set[str]]:
    """(every test of the report, the tests that ran: neither skipped nor an error before they started)."""
    listed, ran = set(), set()
    for case in ElementTree.parse(report).iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        if not classname:
            # A module skipped whole at collection: one case named after the module ("tests.test_x"),
            # which is not a test; the module's tests are in main's collection.
            listed.add(name.replace(".", "/") + ".py")
            continue
        test = node_id(classname, name)
        listed.add(test)
        if case.find("skipped") is None:
            ran.add(test)
    return listed, ran


def module_of(test: str) -> str:
    return test.split("::", 1)[0]


def main(argv: List[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    collected_file, reports = argv[0], argv[1:]
    try:
        with open(collected_file, encoding="utf-8") as lines:
            wanted = {line.strip() for line in lines if "::" in line and not line.startswith(" ")}
    except OSError as exc:
        print(f"  ran: no list of main's tests ({exc}): main did not finish")
        return 1
    if not wanted:
        print("  ran: main collected no test")
        return 1
    ran: Set[str] = set()
    for report in reports:
        try:
            listed, done = cases(report)
        except (OSError, ElementTree.ParseError) as exc:
            print(f"  ran: no readable report {report} ({exc})")
            continue
        wanted |= listed
        ran |= done
    # A module listed as skipped whole ran when any of its tests ran elsewhere.
    modules_ran = {module_of(test) for test in ran}
    missing = sorted(test for test in wanted - ran if "::" in test or test not in modules_ran)
    if missing:
        print(
            f"  ran: {len(missing)} of {len(wanted)} test(s) ran in no environment (left out or skipped in every one):"
        )
        for test in missing:
            print(f"    {test}")
        return 1
    print(f"  ran: each of the {len(wanted)} tests ran in at least one environment")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
