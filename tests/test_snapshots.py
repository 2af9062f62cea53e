"""A task sees its arguments as they were when it was packed, and no write of the parent's is ever lost.

Holding an array once moves its pages onto a shared file while other threads
may write into them (the pool packs ``map`` tasks in its task thread; a NumPy
operation releases the GIL), and a changed array must get a new file while
earlier tasks still read the old one. Each test compares with what
``multiprocessing.Pool`` gives: the parent's array ends with every write made
to it, and each task sees the values of its submission.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from conftest import wait_until
from test_held_once import big

import memshare
from memshare import MemmappingPool, Parallel, delayed
from memshare._parent import _held_once


@pytest.fixture(autouse=True)
def _default_location(default_location):
    """Arrays are held once only where memshare chooses the location."""


def ends(x):
    return float(x[0]), float(x[-1])


def ends_when(x, go):
    """The ends of ``x`` once the file ``go`` exists: a task still pending while the parent writes."""
    assert wait_until(lambda: os.path.exists(go), 60)
    return ends(x)


def arrow_first(array, go=None):
    if go is not None:
        assert wait_until(lambda: os.path.exists(go), 60)
    return array[0].as_py()


def wrong_elements(x: np.ndarray, expected: float) -> int:
    """How many elements of ``x`` are not ``expected`` (a count, so a failure holds no large array)."""
    return int(np.count_nonzero(x != expected))


# -- the parent's writes ---------------------------------------------------------


def test_the_pools_task_thread_never_loses_a_write_of_the_main_thread(mechanism):  # noqa: F811
    # map_async packs (and holds or moves x) in the pool's task thread while
    # the main thread adds to x with the GIL released.
    x = big()
    x[:] = 0.0
    rounds = 30
    with MemmappingPool(2) as pool:
        for _ in range(rounds):
            pending = pool.map_async(ends, [x, x])
            x += 1.0
            pending.get(60)
    assert _held_once.lookup(x) is not None
    assert wrong_elements(x, rounds) == 0


FRONTS = ["pool.map_async", "pool.imap", "pool.apply_async", "Parallel generator"]


def _send_until(front: str, x: np.ndarray, done: threading.Event) -> int:
    """Send ``x`` to tasks through ``front`` until ``done`` is set; the number of calls made."""
    calls = 0
    if front == "Parallel generator":
        with Parallel(n_jobs=2, return_as="generator") as parallel:
            while not done.is_set():
                list(parallel(delayed(ends)(x) for _ in range(4)))
                calls += 1
        return calls
    with MemmappingPool(2) as pool:
        while not done.is_set():
            if front == "pool.map_async":
                pool.map_async(ends, [x] * 4).get(60)
            elif front == "pool.imap":
                list(pool.imap(ends, [x] * 4))
            else:
                [result.get(60) for result in [pool.apply_async(ends, (x,)) for _ in range(4)]]
            calls += 1
    return calls


@pytest.mark.parametrize("front", FRONTS)
def test_a_thread_writing_the_array_while_it_is_sent_never_loses_a_write(mechanism, front):  # noqa: F811
    # np.add releases the GIL: the writer runs while memshare moves x's pages
    # onto a new file, whichever thread does it.
    x = big()
    x[:] = 0.0
    rounds = 60
    done = threading.Event()

    def writer():
        try:
            for _ in range(rounds):
                np.add(x, 1.0, out=x)
        finally:
            done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        calls = _send_until(front, x, done)
    finally:
        done.set()
        thread.join()
    assert calls >= 1 and _held_once.lookup(x) is not None
    assert wrong_elements(x, rounds) == 0


# -- what pending tasks see ----------------------------------------------------------


@pytest.mark.parametrize("promote", [True, False], ids=["held once", "dumped"])
def test_each_task_sees_the_array_of_its_submission_while_earlier_ones_run(mechanism, promote, tmp_path):  # noqa: F811
    x = big()
    with MemmappingPool(3, promote=promote) as pool:
        for repeat in range(20):
            go = str(tmp_path / f"go-{repeat}")
            x[:] = 0.0
            first = pool.apply_async(ends_when, (x, go))
            x[:] = 1.0
            second = pool.apply_async(ends_when, (x, go))
            x[:] = 2.0
            third = pool.apply_async(ends, (x,))
            try:
                assert third.get(60) == (2.0, 2.0)  # while the first two still read theirs
            finally:
                open(go, "w").close()
            assert (first.get(60), second.get(60)) == ((0.0, 0.0), (1.0, 1.0))
    assert (_held_once.lookup(x) is not None) == promote


def test_a_call_sees_the_array_as_it_is_while_another_calls_task_reads_an_older_file(mechanism, tmp_path):  # noqa: F811
    # Arrays held once are the process's: two calls in two threads share the record, not the file.
    x = big()
    x[:] = 0.0
    go = str(tmp_path / "go")
    results = {}

    def first_call():
        results["first"] = Parallel(n_jobs=2)(delayed(ends_when)(x, go) for _ in range(1))

    thread = threading.Thread(target=first_call)
    thread.start()
    try:
        assert wait_until(lambda: _held_once.lookup(x) is not None, 60)
        held = _held_once.lookup(x)
        assert wait_until(lambda: held.file.lifetime.readers == 1, 60)
        x[:] = 1.0
        assert Parallel(n_jobs=2)(delayed(ends)(x) for _ in range(1)) == [(1.0, 1.0)]
    finally:
        open(go, "w").close()
        thread.join()
    assert results["first"] == [(0.0, 0.0)]
    assert memshare.last_call_stats()["arrays_dumped"] == 0


def test_arrow_data_over_writable_memory_is_sent_as_it_was_at_submission(mechanism, tmp_path):  # noqa: F811
    pa = pytest.importorskip("pyarrow")
    values = np.zeros(2_000_000)
    array = pa.Array.from_buffers(pa.float64(), values.size, [None, pa.py_buffer(values)])  # no copy
    assert array.buffers()[1].address == values.ctypes.data
    with MemmappingPool(2) as pool:
        for repeat in range(20):
            go = str(tmp_path / f"go-{repeat}")
            values[0] = 0.0
            first = pool.apply_async(arrow_first, (array, go))
            values[0] = 7.0
            second = pool.apply_async(arrow_first, (array,))
            try:
                assert second.get(60) == 7.0
            finally:
                open(go, "w").close()
            assert first.get(60) == 0.0


def first_value(x):
    return float(x[0])


@pytest.mark.parametrize("front", ["Parallel", "MemmappingPool"])
@pytest.mark.parametrize("mode", ["r", "c"])
def test_a_memmap_whose_file_was_replaced_sends_its_own_values(tmp_path, front, mode):
    # The memmap still maps the old file; the path names a new one (os.replace of a new version).
    path = tmp_path / "data.bin"
    np.full(200_000, 1.0).tofile(path)
    mapped = np.memmap(path, dtype=np.float64, mode="r")
    np.full(200_000, 2.0).tofile(tmp_path / "new.bin")
    os.replace(tmp_path / "new.bin", path)
    if front == "Parallel":
        seen = Parallel(n_jobs=2, max_nbytes="1K", mmap_mode=mode)(delayed(first_value)(mapped) for _ in range(2))
    else:
        with MemmappingPool(2, max_nbytes="1K", mmap_mode=mode) as pool:
            seen = pool.map(first_value, [mapped, mapped])
    assert seen == [float(mapped[0])] * 2 == [1.0, 1.0]


@pytest.mark.skipif(not os.path.isdir("/proc/self/map_files"), reason="Linux's /proc tells a mapping's file")
@pytest.mark.parametrize("split", [False, True], ids=["one region", "split region"])
def test_a_memmap_is_sent_by_reference_only_while_its_path_names_its_file(tmp_path, split):
    # One stat of /proc/self/map_files tells while the kernel keeps the mapping
    # as one region; a region split by madvise sends the check to /proc/self/maps.
    import mmap

    from memshare._transport._backing import find_backing

    path = tmp_path / "data.bin"
    np.full(4 * mmap.PAGESIZE, 1.0).tofile(path)
    mapped = np.memmap(path, dtype=np.float64, mode="r")
    if split:
        mapped._mmap.madvise(mmap.MADV_RANDOM, 0, mmap.PAGESIZE)
    assert find_backing(mapped[1:]) is not None
    np.full(4 * mmap.PAGESIZE, 2.0).tofile(tmp_path / "new.bin")
    os.replace(tmp_path / "new.bin", path)
    assert find_backing(mapped[1:]) is None
    assert find_backing(np.memmap(path, dtype=np.float64, mode="r")) is not None
