"""``memshare.Parallel`` runs on the backend a ``joblib.parallel_config`` names, as its docstring says.

With no backend named anywhere it runs on memshare's; a ``parallel_config``
naming one (``"loky"``, ``"threading"``, ``"dask"``) is followed, as
``Parallel(backend=...)`` is.
"""

from __future__ import annotations

import os
import threading

import joblib
import pytest

import memshare

#: The thread memshare's workers run to exit with their parent: present in memshare's workers only.
WATCH_THREAD = "memshare-parent-watch"


def where(_=None):
    """The process a task runs in, and whether it is one of memshare's workers."""
    return os.getpid(), any(thread.name == WATCH_THREAD for thread in threading.enumerate())


def run(**options):
    return memshare.Parallel(n_jobs=2, **options)(memshare.delayed(where)(i) for i in range(2))


def test_no_backend_named_runs_on_memshares():
    assert all(pid != os.getpid() and ours for pid, ours in run())


@pytest.mark.parametrize("how", ["parallel_config", "argument"])
def test_loky_is_followed(how):
    if how == "argument":
        places = run(backend="loky")
    else:
        with joblib.parallel_config(backend="loky"):
            places = run()
    assert all(pid != os.getpid() and not ours for pid, ours in places), places


def test_threading_is_followed():
    with joblib.parallel_config(backend="threading"):
        assert run() == [(os.getpid(), False)] * 2


def on_dask_worker(_=None):
    distributed = pytest.importorskip("distributed")
    distributed.get_worker()  # raises ValueError outside a Dask worker
    return where()


def test_dask_is_followed():
    distributed = pytest.importorskip("distributed")
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as cluster,
        distributed.Client(cluster),
        joblib.parallel_config(backend="dask"),
    ):
        places = memshare.Parallel()(memshare.delayed(on_dask_worker)(i) for i in range(2))
    assert places == [(os.getpid(), False)] * 2
