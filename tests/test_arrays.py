"""Arrays allocated in shared memory by the user."""

import gc
import os
import pickle
import threading

import numpy as np
import pytest
from conftest import files_under, memshare_entries, run_script, wait_until

import memshare
from memshare import Parallel, delayed


def fill_rows(out, start, stop):
    np.multiply(np.arange(start, stop)[:, None], 1.0, out=out[start:stop])
    return None


def col_sum(x):
    return float(x.sum())


def test_constructors_and_validation(shm_dir):
    a = memshare.empty((3, 4), dtype="f4", order="F")
    assert a.shape == (3, 4) and a.dtype == np.float32 and a.flags.f_contiguous and type(a) is np.ndarray
    assert memshare.zeros(5).sum() == 0
    assert memshare.full((2, 2), 7).tolist() == [[7, 7], [7, 7]]
    source = np.arange(12.0).reshape(3, 4)[:, ::2]
    shared = memshare.share(source)
    np.testing.assert_array_equal(shared, source)
    assert memshare.is_shared(shared) and memshare.is_shared(shared[1:]) and not memshare.is_shared(source)
    assert memshare.share(np.zeros((0, 3))).shape == (0, 3)
    with pytest.raises(TypeError, match="Python objects"):
        memshare.empty(3, dtype=object)
    with pytest.raises(ValueError, match="non-negative"):
        memshare.zeros((-1, 2))
    with pytest.raises(TypeError, match="shape"):
        memshare.zeros("big")
    with pytest.raises(ValueError, match="order"):
        memshare.zeros(3, order="K")


def test_workers_fill_disjoint_slices_and_no_file_is_dumped(shm_dir):
    out = memshare.empty((1000, 50))
    Parallel(n_jobs=2)(delayed(fill_rows)(out, i, i + 100) for i in range(0, 1000, 100))
    np.testing.assert_array_equal(out, np.repeat(np.arange(1000.0)[:, None], 50, axis=1))
    stats = memshare.last_call_stats()
    assert stats["arrays_dumped"] == 0 and stats["arrays_referenced"] == 1  # one array, ten tasks


def test_views_go_by_reference_even_below_the_threshold(shm_dir):
    small = memshare.full(10, 2.0)
    assert Parallel(n_jobs=2)(delayed(col_sum)(small[::2]) for _ in range(3)) == [10.0] * 3
    stats = memshare.last_call_stats()
    assert stats["arrays_dumped"] == 0 and stats["arrays_referenced"] == 3


def test_concurrent_calls_on_one_shared_array(shm_dir):
    out = memshare.zeros((2, 400))

    def run(row):
        Parallel(n_jobs=2)(delayed(fill_rows)(out[row : row + 1].T, i, i + 100) for i in range(0, 400, 100))

    threads = [threading.Thread(target=run, args=(row,)) for row in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    np.testing.assert_array_equal(out, np.tile(np.arange(400.0), (2, 1)))


def test_memory_freed_and_file_deleted_after_del(shm_dir):
    before = len(files_under(shm_dir))
    a = memshare.zeros(64 * 1024**2 // 8)
    a[:] = 1.0
    assert len(files_under(shm_dir)) == before + 1
    size = sum(os.stat(os.path.join(shm_dir, d, f)).st_blocks * 512 for d, fs in memshare_entries(shm_dir) for f in fs)
    assert size >= 64 * 1024**2  # measured: the data is in that file
    del a
    gc.collect()
    assert len(files_under(shm_dir)) == before


def test_pickles_by_value_elsewhere(tmp_path, shm_dir):
    a = memshare.share(np.arange(5.0))
    b = pickle.loads(pickle.dumps(a))
    assert b.tolist() == a.tolist() and not memshare.is_shared(b)
    b[0] = 9
    assert a[0] == 0


def test_file_removed_after_a_parent_crash(tmp_path):
    base = tmp_path / "crash"
    run_script(
        """
        import os, signal, memshare
        a = memshare.zeros(1000)
        os.kill(os.getpid(), signal.SIGKILL)
        """,
        env={"MEMSHARE_TEMP_FOLDER": str(base)},
        check=False,
    )
    wait_until(lambda: not base.exists() or not os.listdir(base), 10, interval=0.1)
    assert not base.exists() or os.listdir(base) == []


def slow_sum(x):
    import time

    time.sleep(0.5)
    return float(x.sum())


def test_deleting_a_shared_array_mid_call_is_safe(shm_dir):
    def make_tasks():
        shared = memshare.full(300_000, 1.0)
        for _ in range(4):
            yield delayed(slow_sum)(shared[::2])
        del shared  # the caller's last reference goes while tasks are pending

    assert Parallel(n_jobs=2, pre_dispatch="all")(make_tasks()) == [150_000.0] * 4
    gc.collect()
    assert files_under(shm_dir) == []


@pytest.mark.parametrize("order", ["K", "C", "F"])
@pytest.mark.parametrize("layout", ["C", "F", "strided", "transposed view"])
def test_share_keeps_values_in_every_requested_order(shm_dir, order, layout):
    base = np.arange(24.0).reshape(2, 3, 4)
    source = {
        "C": base,
        "F": np.asfortranarray(base),
        "strided": base[:, ::2],
        "transposed view": np.arange(24.0).reshape(4, 6)[::2].T,
    }[layout]
    shared = memshare.share(source, order=order)
    np.testing.assert_array_equal(shared, source)
    assert order != "C" or shared.flags.c_contiguous
    assert order != "F" or shared.flags.f_contiguous
