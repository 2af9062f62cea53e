"""A shared array given to workers that get a copy of it says so, rather than losing their writes.

joblib's dask backend (and loky or multiprocessing named explicitly) pickles
a task's arguments with its own pickler: a ``memshare.zeros`` array arrives
by value in a worker of another process or machine, and writes into it never
reach the parent. ``memshare.Parallel`` warns, naming the fixes, when a task
of such a backend takes a writable shared array.
"""

from __future__ import annotations

import warnings

import joblib
import numpy as np
import pytest
from conftest import run_script

import memshare

distributed = pytest.importorskip("distributed")


def fill(out, i):
    out[i] = i + 1


def _copied_warnings(caught) -> list:
    return [w for w in caught if issubclass(w.category, memshare.SharedArrayCopiedWarning)]


def test_dask_workers_in_other_processes_warn_of_lost_writes():
    out = memshare.zeros(4)
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=None) as cluster,
        distributed.Client(cluster),
        joblib.parallel_config(backend="dask"),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # A function made here travels by value: the worker cannot import this test module.
            memshare.Parallel()(memshare.delayed(lambda a, i: fill(a, i))(out, i) for i in range(4))
    copied = _copied_warnings(caught)
    assert len(copied) == 1, [str(w.message) for w in caught]
    message = str(copied[0].message)
    assert "'dask'" in message and "copy" in message and "backend='memshare'" in message, message
    assert "return" in message, message  # the other fix: return the values instead of writing them
    assert not out.any()  # what the warning is about: the parent's array kept its zeros


def test_read_only_or_plain_arrays_and_memshares_backend_do_not_warn():
    out = memshare.zeros(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        memshare.Parallel(n_jobs=2)(memshare.delayed(fill)(out, i) for i in range(4))
        assert out.tolist() == [1.0, 2.0, 3.0, 4.0]
        with joblib.parallel_config(backend="threading"):
            memshare.Parallel(n_jobs=2)(memshare.delayed(fill)(out, i) for i in range(4))
        with joblib.parallel_config(backend="loky"):
            memshare.Parallel(n_jobs=2)(memshare.delayed(np.sum)(x) for x in (np.zeros(4), np.ones(3)))
            view = out[:]
            view.flags.writeable = False
            memshare.Parallel(n_jobs=2)(memshare.delayed(np.sum)(view) for _ in range(2))
            # One job: joblib runs the tasks here, and the writes arrive.
            memshare.Parallel(n_jobs=1)(memshare.delayed(fill)(out, i) for i in range(4))
    assert _copied_warnings(caught) == [], [str(w.message) for w in caught]


def test_loky_named_explicitly_warns_for_a_shared_array_inside_a_tuple():
    out = memshare.zeros(4)
    with warnings.catch_warnings(record=True) as caught, joblib.parallel_config(backend="loky"):
        warnings.simplefilter("always")
        memshare.Parallel(n_jobs=2)(memshare.delayed(fill)(*pair) for pair in [(out, 0), (out, 1)])
        memshare.Parallel(n_jobs=2)(memshare.delayed(len)([(out, 0)]) for _ in range(2))
    copied = _copied_warnings(caught)
    assert len(copied) == 2 and "'loky'" in str(copied[0].message), [str(w.message) for w in caught]


IN_PROCESS_CLUSTER = """
import warnings
import distributed, joblib
import memshare

def fill(out, i):
    out[i] = i + 1

if __name__ == "__main__":
    out = memshare.zeros(4)
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as cluster,
        distributed.Client(cluster),
        joblib.parallel_config(backend="dask"),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            memshare.Parallel()(memshare.delayed(fill)(out, i) for i in range(4))
    copied = [w for w in caught if issubclass(w.category, memshare.SharedArrayCopiedWarning)]
    print(out.tolist(), len(copied))
"""


def test_dask_workers_in_this_process_share_the_array_and_say_nothing():
    # In a fresh interpreter: an in-process cluster keeps the task's arguments (the shared array among
    # them) past the call, which this process's later "nothing left" checks would count.
    run = run_script(IN_PROCESS_CLUSTER, timeout=240)
    assert run.stdout.strip().splitlines()[-1] == "[1.0, 2.0, 3.0, 4.0] 0", run.stdout
