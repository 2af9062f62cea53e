"""The private names of other libraries memshare relies on exist in the installed versions.

Run in every environment of CI's version matrix, so a release that renames
one of them fails here, naming it, rather than somewhere deep in a call.
"""

from __future__ import annotations

import dataclasses
import threading
import types

import pytest

from memshare import _compat
from memshare._compat import _probes
from memshare._tools import doctor as _doctor


@pytest.mark.parametrize("check", _compat.CHECKS, ids=lambda check: check.name)
def test_every_private_name_is_found_in_the_installed_versions(check):
    assert check.found, f"{check.name} is missing: {check.why}"


def test_an_attribute_that_no_method_uses_is_reported_missing():
    class Local:
        def __init__(self):
            self.present = 1

    assert _probes.uses_attribute(Local, "present")
    assert not _probes.uses_attribute(Local, "absent")


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


def test_the_state_of_an_arrow_backed_array_is_pandas_own():
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    if getattr(pd.arrays, "ArrowExtensionArray", None) is None:
        pytest.skip("this pandas has no ArrowExtensionArray: memshare pickles its arrays as pandas does")
    array = pd.array(["a", "b", None], dtype="string[pyarrow]")
    # Before Python 3.11, a class without __getstate__ (pandas 1.5's) pickles its __dict__: that is its state.
    getstate = getattr(array, "__getstate__", None)
    pandas_state = getstate() if getstate is not None else dict(array.__dict__)
    ours = _compat.pandas_array_state(array)
    assert set(ours) == set(pandas_state)
    assert ours.get("_cache") == pandas_state.get("_cache")


def test_exit_codes_are_read_from_a_terminated_worker_error_as_loky_writes_it():
    from joblib.externals.loky.process_executor import TerminatedWorkerError, get_exitcodes_terminated_worker

    dead = {1: types.SimpleNamespace(exitcode=-9), 2: types.SimpleNamespace(exitcode=None)}
    codes = get_exitcodes_terminated_worker(dead)
    error = TerminatedWorkerError(f"A worker died.\nThe exit codes of the workers are {codes}")
    assert _compat.terminated_worker_exit_codes(error) == [-9]


def test_an_unclosed_pool_that_never_started_warns_nothing(recwarn):
    pool = _compat.PoolWithHooks.__new__(_compat.PoolWithHooks)
    pool.__del__()  # __init__ never ran: nothing to warn about, nothing to stop
    assert not [warning for warning in recwarn if issubclass(warning.category, ResourceWarning)]
