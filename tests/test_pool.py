"""MemmappingPool across real processes."""

import gc
import multiprocessing as mp
import os
import signal
import stat
import threading
import time
import weakref

import numpy as np
import pytest
from conftest import alive, files_under, memshare_entries, open_descriptors, total, wait_until

import memshare
from memshare import MemmappingPool


def kind(x):
    return type(x).__name__, x.flags.writeable, x.shape


def add(x, y=0):
    return x + y


def write_first(x):
    x[0] = 99.0
    return float(x[0])


def write_or_read(x, write):
    if write:
        x[0] = 99.0
    return float(x.sum())


def sleep_forever(_):
    time.sleep(60)


def pid(_):
    return os.getpid()


def make(n):
    return np.full(n, 3.0)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_full_api_under_every_start_method(shm_dir, method):
    data = np.arange(100_000.0)
    with MemmappingPool(2, context=mp.get_context(method), max_nbytes="10K") as pool:
        assert pool.apply(total, (data,)) == data.sum()
        assert pool.apply_async(kind, (data,)).get(timeout=60) == ("memmap", False, (100_000,))
        assert pool.map(total, [data, data[::2]]) == [data.sum(), data[::2].sum()]
        assert pool.map_async(total, [data]).get(timeout=60) == [data.sum()]
        assert list(pool.imap(total, iter([data, data[:10]]))) == [data.sum(), data[:10].sum()]
        assert sorted(pool.imap_unordered(total, [data[:5], data[:3]])) == sorted([data[:5].sum(), data[:3].sum()])
        assert pool.starmap(add, [(1, 2), (3, 4)]) == [3, 7]
        assert pool.starmap_async(add, [(data[:3], 1)]).get(timeout=60)[0].tolist() == [1.0, 2.0, 3.0]
        assert pool.apply(add, (1,), {"y": 5}) == 6
        assert len(files_under(shm_dir)) >= 1
    assert memshare_entries(shm_dir) == []


def test_same_array_to_100_tasks_makes_one_file(shm_dir):
    data = np.ones(200_000)
    with MemmappingPool(2) as pool:
        results = [pool.apply_async(total, (data,)) for _ in range(100)]
        assert [r.get(timeout=60) for r in results] == [200_000.0] * 100
        assert pool.map(total, [data] * 100) == [200_000.0] * 100
    stats = memshare.last_call_stats()
    # 100 apply_async tasks, then map's 100 items in 8 chunks of 13 (the standard pool's default chunk size)
    assert stats["arrays_dumped"] == 1 and stats["tasks"] == 108


def test_fresh_arrays_from_a_generator_never_alias(shm_dir):
    with MemmappingPool(2) as pool:
        sums = list(pool.imap(total, (np.full(200_000, float(i)) for i in range(30))))
    assert sums == [200_000.0 * i for i in range(30)]


def test_no_folder_when_nothing_crosses_the_threshold(shm_dir):
    with MemmappingPool(2) as pool:
        assert pool.map(total, [np.ones(10)] * 5) == [10.0] * 5
        assert memshare_entries(shm_dir) == []


def inplace_double(args):
    data, position, expected = args
    assert data[position] == expected
    data[position] *= 2


def test_memmaps_alone_make_nothing_in_the_temp_folder(tmp_path):
    """Memmaps travel as references and their small tuples in the tasks: the pool's folder stays empty.

    Each task's argument, a tuple around the memmap, pickles to more than
    ``max_nbytes=2``; it stays in the task (argument objects go to a file only
    when large), so nothing is written, as with joblib's pool.
    """
    folder = tmp_path / "pool"
    folder.mkdir()
    with MemmappingPool(10, max_nbytes=2, temp_folder=str(folder)) as pool:
        a = np.memmap(str(tmp_path / "test.mmap"), dtype=np.float32, shape=(3, 5), mode="w+")
        a.fill(1.0)
        pool.map(inplace_double, [(a, (i, j), 1.0) for i in range(3) for j in range(5)])
        assert os.listdir(folder) == []
        np.testing.assert_array_equal(a, 2.0)
        b = np.memmap(str(tmp_path / "test.mmap"), dtype=np.float32, shape=(5, 3), mode="c")
        pool.map(inplace_double, [(b, (i, j), 2.0) for i in range(5) for j in range(3)])
        assert os.listdir(folder) == []
        np.testing.assert_array_equal(b, 2.0)  # the workers' writes stayed in their private copies
    assert os.listdir(folder) == []


@pytest.mark.parametrize("finish", ["terminate", "close_join", "context"])
def test_files_removed_on_every_way_of_finishing(shm_dir, finish):
    data = np.ones(300_000)
    pool = MemmappingPool(2)
    if finish == "context":
        with pool:
            pool.map(total, [data] * 4)
    else:
        pool.map(total, [data] * 4)
        assert files_under(shm_dir)
        if finish == "terminate":
            pool.terminate()
        else:
            pool.close()
            pool.join()
    assert memshare_entries(shm_dir) == []


def finish_pool(pool, finish):
    if finish == "terminate":
        pool.terminate()
    elif finish == "close":
        pool.close()
    else:
        pool.close()
        pool.join()


@pytest.mark.parametrize("finish", ["context", "close_join", "terminate", "close"])
def test_finished_pools_keep_no_descriptors_without_a_collection(shm_dir, finish):
    """A finished pool, once dropped, leaves no pipe open until a garbage collection, as the standard pool.

    The collector is off during the loop: a descriptor kept only by a reference cycle would stay open. A
    pool only closed ends its workers when it is dropped (its finalizer terminates them), and its watch
    thread lets go of them as it ends: its descriptors go within moments.
    """
    with MemmappingPool(2) as pool:  # the process's first pool opens what lives as long as the process
        pool.map(add, range(4))
    del pool
    gc.collect()
    gc.disable()
    try:
        before = open_descriptors()
        for _ in range(4):
            pool = MemmappingPool(2)
            if finish == "context":
                with pool:
                    assert pool.map(add, range(4)) == [0, 1, 2, 3]
            else:
                assert pool.map(add, range(4)) == [0, 1, 2, 3]
                finish_pool(pool, finish)
        del pool
        if finish == "close":
            # Compared as sets: another thread may close descriptors of its own meanwhile (seen in CI).
            assert wait_until(lambda: not open_descriptors() - before, 30), open_descriptors() - before
        assert open_descriptors() - before == set()
    finally:
        gc.enable()


def test_permissions_are_private_even_with_umask_zero(shm_dir):
    old = os.umask(0)
    try:
        data = np.ones(300_000)
        with MemmappingPool(1) as pool:
            pool.map(total, [data, data])
            ((folder, files),) = memshare_entries(shm_dir)
            path = shm_dir / folder
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
            assert all(stat.S_IMODE(os.stat(path / f).st_mode) == 0o600 for f in files)
    finally:
        os.umask(old)


def test_writable_modes(shm_dir, tmp_path):
    user = np.memmap(tmp_path / "user.dat", dtype="f8", mode="w+", shape=(200_000,))
    with MemmappingPool(2, mmap_mode="r") as pool:
        # The user's own writable memmap: workers write into it, the parent sees it.
        assert pool.apply(write_first, (user,)) == 99.0
        assert user[0] == 99.0
        # A dumped array in 'r' mode is read-only in the worker.
        with pytest.raises(ValueError, match="read-only"):
            pool.apply(write_first, (np.zeros(200_000),))
    dumped = np.zeros(200_000)
    with MemmappingPool(1, mmap_mode="c") as pool:
        assert pool.apply(write_first, (dumped,)) == 99.0  # private copy-on-write
        assert pool.apply(total, (dumped,)) == 0.0  # the next task sees the file unchanged
    assert dumped[0] == 0.0
    with MemmappingPool(1, mmap_mode="r+") as pool:
        # Within one call, a write is seen by the tasks that follow it.
        assert pool.starmap(write_or_read, [(dumped, True), (dumped, False)], chunksize=1) == [99.0, 99.0]
        # A new call re-sends the parent's array, which is the reference.
        assert pool.apply(total, (dumped,)) == 0.0
    assert dumped[0] == 0.0  # the parent's own copy is never written
    del user


def test_large_results_come_back_as_plain_writable_arrays(shm_dir):
    with MemmappingPool(2) as pool:
        small, big = pool.map(make, [10, 500_000])
        assert type(big) is np.ndarray and big.flags.writeable and big.sum() == 1_500_000.0
        big[0] = 1.0
    assert memshare.last_call_stats()["results_by_reference"] == 1
    assert memshare_entries(shm_dir) == []


def test_task_exceptions_keep_their_type_and_remote_traceback(shm_dir):
    with MemmappingPool(2) as pool:
        with pytest.raises(TypeError) as info:
            pool.apply(add, ("a", 1))
        assert "Traceback" in str(info.value.__cause__)
        with pytest.raises(TypeError):
            pool.map(add, [1, "b"])
        assert pool.apply(add, (1, 1)) == 2  # still usable


def announce_then_sleep(marker, _):
    open(marker, "w").close()
    time.sleep(60)


def test_killed_worker_fails_pending_tasks_promptly(shm_dir, tmp_path):
    data = np.ones(300_000)
    with MemmappingPool(2) as pool:
        pids = set(pool.map(pid, range(20)))
        pending = pool.apply_async(announce_then_sleep, (str(tmp_path / "started"), data))
        assert wait_until(lambda: (tmp_path / "started").exists(), 30), "the task never started"
        for worker_pid in pids:
            os.kill(worker_pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(memshare.WorkerDiedError, match="SIGKILL"):
            pending.get(timeout=30)
        assert time.monotonic() - started < 10
        with pytest.raises(memshare.WorkerDiedError, match="create a new one"):
            pool.apply_async(add, (2, 3))  # broken: says so instead of hanging
    assert memshare_entries(shm_dir) == []  # terminate() did not hang, and cleaned up


def test_a_pool_dropped_unclosed_is_collected_warns_and_ends_its_workers(shm_dir):
    threads_before = set(threading.enumerate())
    pool = MemmappingPool(2)
    assert pool.map(total, [np.ones(300_000)] * 4) == [300_000.0] * 4  # dumped: the pool has a folder
    watch = pool._watch  # holds no reference to the pool
    assert wait_until(lambda: len(watch.watched_pids()) == 2, 30), "the watch never saw both workers"
    workers = watch.watched_pids()
    collected = weakref.ref(pool)
    with pytest.warns(ResourceWarning, match="unclosed running MemmappingPool"):
        del pool
        gc.collect()
    gc.collect()  # the warning held the pool as its source until pytest.warns let it go
    assert collected() is None
    assert wait_until(lambda: not any(alive(worker) for worker in workers), 30), "a worker outlived its pool"
    assert wait_until(lambda: memshare_entries(shm_dir) == [], 30), memshare_entries(shm_dir)
    assert wait_until(lambda: set(threading.enumerate()) <= threads_before, 30), "a thread outlived its pool"


def read_global(_):
    return INITIALISED.get("value"), os.getpid()


INITIALISED = {}


def initialise(value):
    INITIALISED["value"] = value


def test_initializer_and_maxtasksperchild(shm_dir):
    with MemmappingPool(2, initializer=initialise, initargs=(7,), maxtasksperchild=2) as pool:
        out = pool.map(read_global, range(12), chunksize=1)
    assert {value for value, _ in out} == {7}
    assert len({worker for _, worker in out}) > 2  # workers were replaced after 2 tasks each


def test_the_pools_worker_thread_wakes_for_worker_exits_and_changes_not_for_each_result(shm_dir):
    # The standard list has the result pipe, ready until the result thread reads each result: the worker
    # thread then spun, polling every worker, several times per small task.
    with MemmappingPool(1, maxtasksperchild=2) as pool:
        sentinels = pool._get_sentinels()
        assert pool._outqueue._reader not in sentinels
        assert pool._change_notifier._reader in sentinels
        assert len({pool.apply(pid, (i,)) for i in range(6)}) == 3  # exited workers are still replaced
