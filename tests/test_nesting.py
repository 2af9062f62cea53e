"""Nested calls follow joblib's rules for its loky backend, with joblib's warnings.

Each case runs the same nested call once with joblib's own ``"loky"`` backend
and once with memshare, in the same place, and compares what happened: the
warnings given and whether the inner tasks ran in the calling thread
(sequentially) or elsewhere.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import warnings

import joblib
import pytest
from joblib import delayed

import memshare


def where(_):
    return os.getpid(), threading.get_ident()


def nested_call(backend):
    """Run a nested 2-job call; return (its warnings, whether it ran in this very thread)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if backend == "memshare.Parallel":
            parallel = memshare.Parallel(n_jobs=2)
        else:
            parallel = joblib.Parallel(n_jobs=2, backend=backend)
        places = set(parallel(delayed(where)(i) for i in range(4)))
    here = (os.getpid(), threading.get_ident())
    # joblib's nesting warnings are UserWarnings; old joblib on a new Python adds
    # DeprecationWarnings of its own, which say nothing about nesting.
    messages = sorted(str(w.message) for w in caught if not issubclass(w.category, DeprecationWarning))
    return messages, places == {here}


def test_below_a_thread_falls_back_with_lokys_warning():
    """Under a threading call, a nested process call runs sequentially and says so, as joblib's loky does."""
    outer = joblib.Parallel(n_jobs=2, backend="threading")
    loky = outer(delayed(nested_call)("loky") for _ in range(1))
    mine = outer(delayed(nested_call)("memshare") for _ in range(1))
    assert loky == [(["Loky-backed parallel loops cannot be nested below threads, setting n_jobs=1"], True)]
    assert mine == loky


def test_in_a_daemonic_process_falls_back_with_lokys_warning():
    """In a multiprocessing.Pool worker (daemonic: no children allowed), the fallback warns as joblib's loky does."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        loky = pool.map(nested_call, ["loky"])
        mine = pool.map(nested_call, ["memshare", "memshare.Parallel"])
    expected = (["Loky-backed parallel loops cannot be called in a multiprocessing, setting n_jobs=1"], True)
    assert loky == [expected]
    assert mine == [expected, expected]


@pytest.mark.parametrize("backend", ["multiprocessing", "memshare.Parallel", "loky"])
def test_inside_a_memshare_worker_as_inside_a_loky_worker(backend):
    """A memshare worker counts as a loky worker (it runs joblib's bundled loky): joblib's multiprocessing
    backend sees it is nested (and falls back with its warning), a default nested call uses threads, an explicit
    one warns nothing."""
    loky = joblib.Parallel(n_jobs=2, backend="loky")(delayed(nested_call)(backend) for _ in range(1))
    mine = joblib.Parallel(n_jobs=2, backend="memshare")(delayed(nested_call)(backend) for _ in range(1))
    if backend == "multiprocessing":
        warning = "Multiprocessing-backed parallel loops cannot be nested, below loky, setting n_jobs=1"
        assert loky == [([warning], True)]
    assert mine == loky
