"""The private names of other libraries memshare relies on exist in the installed versions.

Run in every environment of CI's version matrix, so a release that renames
one of them fails here, naming it, rather than somewhere deep in a call.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from memshare import _compat, _doctor


@pytest.mark.parametrize("check", _compat.CHECKS, ids=lambda check: check.name)
def test_every_private_name_is_found_in_the_installed_versions(check):
    assert check.found, f"{check.name} is missing: {check.why}"


def test_an_attribute_that_no_method_uses_is_reported_missing():
    class Local:
        def __init__(self):
            self.present = 1

    assert _compat._uses_attribute(Local, "present")
    assert not _compat._uses_attribute(Local, "absent")


def test_doctor_names_a_missing_internal_as_a_problem(monkeypatch):
    gone = dataclasses.replace(_compat.CHECKS[0], found=False)
    monkeypatch.setattr(_compat, "CHECKS", (gone,) + _compat.CHECKS[1:])
    lines = []
    assert _doctor.run_doctor(say=lines.append) == 1
    problems = [line for line in lines if line.startswith("PROBLEM:")]
    assert any(gone.name in line and "tested" in line for line in problems), lines


def test_a_lock_held_at_a_fork_is_reset_by_reinit_lock():
    lock = threading.Lock()
    lock.acquire()
    _compat.reinit_lock(lock)
    assert lock.acquire(blocking=False)
