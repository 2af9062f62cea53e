"""Large results come back through shared memory, with no copy."""

import os
import signal

import numpy as np
import pandas as pd
import psutil
import pytest
from conftest import files_under, memshare_entries, wait_until

import memshare
from memshare import MemmappingPool, Parallel, delayed


def make(n, dtype="f8", order="C"):
    return np.asfortranarray(np.arange(n, dtype=dtype).reshape(-1, 2)) if order == "F" else np.arange(n, dtype=dtype)


def nested_result(n):
    return {"a": (np.ones(n), [np.zeros(n)]), "frame": pd.DataFrame({"x": np.arange(n, dtype=float)})}


def head_view(x):
    return x[:1000]


def own_memory():
    """This process's resident anonymous plus shared-memory pages.

    Per process rather than the machine's Shmem, which other processes move.
    An unlinked tmpfs file's pages are freed when its last mapping goes, and
    the worker wrote the result with write() and kept no mapping.
    """
    total = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("RssAnon:", "RssShmem:")):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.parametrize("dtype", ["f8", ">i4", "c16"])
@pytest.mark.parametrize("order", ["C", "F"])
def test_values_dtypes_orders_preserved_and_arrays_plain_writable(shm_dir, dtype, order):
    out = Parallel(n_jobs=2)(delayed(make)(400_000, dtype, order) for _ in range(2))
    want = make(400_000, dtype, order)
    for got in out:
        assert type(got) is np.ndarray and got.flags.writeable
        assert got.dtype == want.dtype and got.flags.f_contiguous == want.flags.f_contiguous
        np.testing.assert_array_equal(got, want)
    assert memshare.last_call_stats()["results_by_reference"] == 2
    assert memshare_entries(shm_dir) == []


def test_nested_containers_and_dataframes(shm_dir):
    (result,) = Parallel(n_jobs=2)(delayed(nested_result)(200_000) for _ in range(1))
    assert result["a"][0].sum() == 200_000 and result["a"][1][0].sum() == 0
    assert result["frame"]["x"].sum() == sum(range(200_000))
    assert memshare.last_call_stats()["results_by_reference"] >= 3


def test_memory_is_released_when_the_result_is_deleted(monkeypatch):
    monkeypatch.delenv("MEMSHARE_TEMP_FOLDER", raising=False)  # the real /dev/shm: RssShmem counts it
    nbytes = 256 * 1024**2
    with MemmappingPool(1) as pool:
        before = own_memory()
        result = pool.apply(np.ones, (nbytes // 8,))
        assert result.sum() == nbytes // 8
        held = own_memory() - before
        folder = pool.temp_folder
        # The name was removed at once (the folder keeps only the result inbox's socket, if any).
        assert not os.path.isdir(folder) or [n for n in os.listdir(folder) if not n.startswith("inbox-")] == []
        del result
        released = own_memory() - before
        with open("/proc/self/maps") as maps:
            assert folder not in maps.read()  # no mapping of the result file is left
    assert held > 0.8 * nbytes  # measured, not assumed: the result really was here
    assert released < 0.2 * nbytes


def test_views_of_user_memmaps_come_back_as_references(tmp_path, shm_dir):
    user = np.memmap(tmp_path / "u.dat", dtype="f8", mode="w+", shape=(300_000,))
    (view,) = Parallel(n_jobs=2)(delayed(head_view)(user) for _ in range(1))
    view[0] = 7.0
    user.flush()
    assert user[0] == 7.0  # the same memory
    assert memshare.last_call_stats()["results_by_reference"] == 0
    del view, user


def test_views_of_dumped_inputs_come_back_independent(shm_dir):
    data = np.arange(300_000.0)
    with Parallel(n_jobs=2, max_nbytes=1000) as parallel:
        (view,) = parallel(delayed(head_view)(data) for _ in range(1))
    assert memshare_entries(shm_dir) == []  # the dump is gone, the result lives on
    np.testing.assert_array_equal(view, data[:1000])
    view[0] = -1
    assert data[0] == 0


def test_shared_array_views_come_back_as_the_same_memory(shm_dir):
    out = memshare.zeros(300_000)
    (view,) = Parallel(n_jobs=2)(delayed(head_view)(out) for _ in range(1))
    view[3] = 5.0
    assert out[3] == 5.0


def test_a_killed_worker_leaks_nothing(shm_dir):
    def die(_):
        os.kill(os.getpid(), 9)

    with pytest.raises(memshare.WorkerDiedError, match="SIGKILL"):
        Parallel(n_jobs=2)(delayed(die)(np.ones(300_000)) for _ in range(2))
    assert memshare_entries(shm_dir) == []


def write_result_then_die(n):
    """Return a large array from a worker that is killed right after writing it, before sending it."""
    import memshare._worker._result_files as result_files  # the module that calls fill_result_file, in this worker

    real = result_files.fill_result_file

    def fill_then_die(*args, **kwargs):
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    result_files.fill_result_file = fill_then_die  # the worker dies with the patch
    return np.ones(n)


def test_a_worker_killed_after_writing_a_result_leaks_nothing(shm_dir):
    with pytest.raises(memshare.WorkerDiedError, match="SIGKILL"):
        Parallel(n_jobs=2)(delayed(write_result_then_die)(300_000) for _ in range(1))
    assert memshare_entries(shm_dir) == []


def allocate_in_worker(n):
    out = memshare.empty(n)
    out[:] = 2.0
    return out, out[::2]


def test_shared_arrays_allocated_in_a_worker_are_handed_over_without_a_copy(shm_dir):
    ((whole, half),) = Parallel(n_jobs=2)(delayed(allocate_in_worker)(400_000) for _ in range(1))
    assert type(whole) is np.ndarray and whole.flags.writeable and whole.sum() == 800_000.0
    assert half.shape == (200_000,) and half.strides == (16,)
    stats = memshare.last_call_stats()
    assert stats["results_by_reference"] == 2 and stats["arrays_dumped"] == 0
    half[0] = 5.0
    assert whole[0] == 5.0  # both views map the same pages, as in the worker
    # The worker's own name goes when its array is collected there.
    assert wait_until(lambda: files_under(shm_dir) == [], 10), files_under(shm_dir)


def sparse_and_estimator(n):
    from scipy import sparse
    from sklearn.linear_model import LinearRegression

    rng = np.random.default_rng(0)
    X = rng.standard_normal((n, 4))
    model = LinearRegression().fit(X, X @ np.arange(4.0))
    model.big_attribute_ = np.arange(float(n))  # fitted attributes can be large arrays
    matrix = sparse.csr_matrix((np.arange(1.0, n + 1), (np.arange(n), np.arange(n) % 7)), shape=(n, 7))
    return matrix, model


def test_sparse_matrices_and_estimators_come_back_through_files(shm_dir):
    ((matrix, model),) = Parallel(n_jobs=2)(delayed(sparse_and_estimator)(300_000) for _ in range(1))
    assert matrix.shape == (300_000, 7) and matrix.sum() == sum(range(1, 300_001))
    assert type(matrix.data) is np.ndarray and matrix.data.flags.writeable
    np.testing.assert_allclose(model.coef_, np.arange(4.0), atol=1e-9)
    np.testing.assert_array_equal(model.big_attribute_, np.arange(300_000.0))
    # data, indices and the estimator's attribute are large enough to travel as files
    assert memshare.last_call_stats()["results_by_reference"] >= 3
    assert memshare_entries(shm_dir) == []


BEYOND_4_GIB = 4 * 1024**3 + 3 * 4096 + 5  # odd size: the last piece is partial
MARKS = [0, 2**31 - 1, 2**31, 2**32 - 1, 2**32, BEYOND_4_GIB - 1]


def marked_zeros(nbytes):
    out = np.zeros(nbytes, dtype=np.uint8)  # calloc: untouched pages cost no memory in the worker
    for position in MARKS:
        out[position] = 1 + position % 251
    return out


def _room_for_a_result_beyond_4_gib():
    need = 2 * BEYOND_4_GIB  # the result in shared memory, and slack for the rest of the machine
    shm = os.statvfs("/dev/shm")
    available = psutil.virtual_memory().available
    if shm.f_bavail * shm.f_frsize < need or available < need:
        return f"needs {need / 1024**3:.0f} GiB free in memory and in /dev/shm"
    return None


@pytest.mark.version_independent
@pytest.mark.skipif(_room_for_a_result_beyond_4_gib() is not None, reason=str(_room_for_a_result_beyond_4_gib()))
def test_results_larger_than_4_gib(monkeypatch):
    monkeypatch.delenv("MEMSHARE_TEMP_FOLDER", raising=False)  # the real /dev/shm: the result is RAM-sized
    (result,) = Parallel(n_jobs=2)(delayed(marked_zeros)(BEYOND_4_GIB) for _ in range(1))
    assert type(result) is np.ndarray and result.nbytes == BEYOND_4_GIB
    assert [int(result[p]) for p in MARKS] == [1 + p % 251 for p in MARKS]  # offsets past 2 and 4 GiB are right
    assert int(np.count_nonzero(result)) == len(MARKS)
    assert memshare.last_call_stats()["results_by_reference"] == 1
    del result
