"""Arrays over the user's own ``mmap.mmap`` of a file: the parent's values, and the call's mode.

A private mapping (``ACCESS_COPY``, ``MAP_PRIVATE``) keeps the parent's
writes in private pages its file does not have: such an array travels by
reference only while none of its pages is written, else as a copy; a
result over a worker's private mapping is copied. A shared mapping is the
user's file itself: workers map it read-only under ``mmap_mode='r'`` and
copy-on-write under ``'c'``, and under ``'r+'``/``'w+'`` they get a copy, as
joblib gives (it copies every array that is not an ``np.memmap``): the file
changes only through the parent. An ``np.memmap`` keeps its own mode under
every call mode, as joblib keeps it. Each case is compared with serial
execution and with joblib's loky backend.
"""

from __future__ import annotations

import mmap
import os
import sys

import joblib
import numpy as np
import pytest
from conftest import NAMED, memfds_held, memshare_entries

import memshare
from memshare import MemmappingPool, Parallel, delayed

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")

N = 2 * 1024**2 // 8  # 2 MiB of float64: above the default max_nbytes (1M)
MODES = ("r", "c", "r+", "w+")
# Tests run grouped by the call's mode (conftest): joblib starts new workers whenever the mode changes.
RUN_GROUPED_BY = "mode"


@pytest.fixture(params=["memfd", NAMED])
def location(request):
    """Where memshare puts the files it writes: memfds (its own choice) or named files in a folder of the test."""
    if request.param == "memfd":
        request.getfixturevalue("default_location")
        yield None
        assert memfds_held() == []
    else:
        base = request.getfixturevalue("shm_dir")
        yield base
        assert memshare_entries(base) == []


@pytest.fixture(params=["parallel", "pool"])
def runner(request):
    """Runs ``func`` over ``items`` in workers with ``mmap_mode``: memshare's Parallel or its MemmappingPool."""

    def run(func, items, mode="r"):
        if request.param == "parallel":
            return Parallel(n_jobs=2, mmap_mode=mode)(delayed(func)(item) for item in items)
        with MemmappingPool(2, mmap_mode=mode) as pool:
            return pool.map(func, items)

    run.name = request.param
    return run


def with_joblib(func, items, mode="r"):
    return joblib.Parallel(n_jobs=2, backend="loky", mmap_mode=mode)(joblib.delayed(func)(item) for item in items)


def write_file(path, value) -> str:
    np.full(N, value, dtype=np.float64).tofile(path)
    return str(path)


def mapped(path, how: str) -> np.ndarray:
    """An array over a new ``mmap.mmap`` of the file: 'shared', 'read' (read-only), 'access' or 'flags' (private)."""
    fd = os.open(path, os.O_RDWR)
    try:
        if how == "shared":
            raw = mmap.mmap(fd, 0)
        elif how == "read":
            raw = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        elif how == "access":
            raw = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        else:
            raw = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE)
    finally:
        os.close(fd)
    return np.frombuffer(raw, dtype=np.float64)


def file_values(path) -> np.ndarray:
    return np.fromfile(path, dtype=np.float64)


def first_last_total(a: np.ndarray):
    return float(a[0]), float(a[-1]), float(a.sum())


def what_the_task_sees(a: np.ndarray):
    """The task's argument as it reaches the task: its file, mode, writability and first value."""
    return getattr(a, "filename", None), getattr(a, "mode", None), bool(a.flags.writeable), float(a[0])


def write_two(a: np.ndarray):
    """Write 2.0 over the argument when the task may; what happened and what the task then reads."""
    try:
        a[:] = 2.0
    except ValueError:  # "assignment destination is read-only"
        return "read-only", float(a[0])
    return "wrote", float(a[0])


def private_result(path: str) -> np.ndarray:
    """A result over the worker's own private mapping of ``path``, written: its pages differ from the file."""
    a = mapped(path, "access")
    a[:] = 7.0
    return a


# -- item 1: a private mapping's written pages ----------------------------------


@pytest.mark.parametrize("how", ["access", "flags"])
@pytest.mark.parametrize("mode", ["r", "c"])
def test_a_private_mapping_the_parent_wrote_reaches_workers_with_its_values(tmp_path, location, runner, how, mode):
    path = write_file(tmp_path / "zeros.f8", 0.0)
    a = mapped(path, how)
    a[0] = a[-1] = 5.0  # two private pages; every other page is still the file's
    serial = first_last_total(a)
    assert serial == (5.0, 5.0, 10.0)
    assert with_joblib(first_last_total, [a, a], mode) == [serial] * 2
    assert runner(first_last_total, [a, a], mode) == [serial] * 2
    if runner.name == "parallel":
        assert memshare.last_call_stats()["arrays_dumped"] == 1  # a copy: the file is not its content
    assert not file_values(path).any()  # the parent's writes stayed its own
    del a


@pytest.mark.parametrize("mode", ["r", "c"])
def test_an_unwritten_private_mapping_goes_by_reference_with_the_calls_mode(tmp_path, location, runner, mode):
    path = write_file(tmp_path / "ones.f8", 1.0)
    a = mapped(path, "access")
    assert float(a.sum()) == N  # read, not written: every page is still the file's
    seen = runner(what_the_task_sees, [a], mode)
    assert seen == [(path, mode, mode == "c", 1.0)]
    if runner.name == "parallel":
        assert memshare.last_call_stats()["arrays_dumped"] == 0
    assert runner(write_two, [a], mode) == with_joblib(write_two, [a], mode)
    assert not (file_values(path) - 1.0).any() and not (a - 1.0).any()
    del a


def test_a_result_over_a_workers_private_mapping_comes_back_with_its_values(tmp_path, location, runner):
    path = write_file(tmp_path / "zeros.f8", 0.0)
    serial = first_last_total(private_result(path))
    assert serial == (7.0, 7.0, 7.0 * N)
    assert [first_last_total(r) for r in with_joblib(private_result, [path])] == [serial]
    results = runner(private_result, [path, path])
    assert [first_last_total(r) for r in results] == [serial] * 2
    assert not file_values(path).any()
    del results


# -- item 2: the user's file is written only as the call's mode allows -----------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["shared", "read"])
def test_a_mapping_of_the_users_file_is_written_only_as_the_call_allows(tmp_path, location, runner, how, mode):
    # joblib copies the array and maps the copy with the call's mode: a read-only
    # error under 'r', a task's own writes under 'c', 'r+' and 'w+'; the file keeps 1.0.
    path = write_file(tmp_path / "ones.f8", 1.0)
    a = mapped(path, how)
    expected = with_joblib(write_two, [a], mode)
    assert expected == [("read-only", 1.0) if mode == "r" else ("wrote", 2.0)]
    assert not (file_values(path) - 1.0).any()
    assert runner(write_two, [a], mode) == expected
    assert not (file_values(path) - 1.0).any(), f"{int((file_values(path) != 1.0).sum())} elements of the file written"
    assert not (a - 1.0).any()
    del a


@pytest.mark.parametrize("mode", ["r", "c"])
def test_a_shared_mapping_goes_by_reference_mapped_with_the_calls_mode(tmp_path, location, mode):
    path = write_file(tmp_path / "ones.f8", 1.0)
    a = mapped(path, "shared")
    view = a[1:]  # a view travels as one too, with its offset in the file
    seen = Parallel(n_jobs=2, mmap_mode=mode)(delayed(what_the_task_sees)(view) for _ in range(2))
    assert seen == [(path, mode, mode == "c", 1.0)] * 2
    stats = memshare.last_call_stats()
    assert stats["arrays_dumped"] == 0 and stats["arrays_referenced"] == 1
    del a, view


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("memmap_mode", ["r", "r+", "w+", "c"])
def test_a_memmap_keeps_its_own_mode_under_every_call_mode(tmp_path, runner, memmap_mode, mode):
    # Its mode is the user's choice, whatever the call's: 'r+' writes reach the file,
    # 'r' refuses them, 'c' keeps them in the task (unwritten in the parent: referenced).
    path = write_file(tmp_path / "ones.f8", 1.0)
    if memmap_mode == "w+":
        m = np.memmap(path, dtype=np.float64, mode="w+", shape=(N,))
        m[:] = 1.0
    else:
        m = np.memmap(path, dtype=np.float64, mode=memmap_mode)
    shared_writes = memmap_mode in ("r+", "w+")
    expected = with_joblib(write_two, [m], mode)
    assert expected == [("read-only", 1.0) if memmap_mode == "r" else ("wrote", 2.0)]
    if shared_writes:
        m[:] = 1.0  # undo what joblib's task wrote through the file
    assert runner(write_two, [m], mode) == expected
    assert not (file_values(path) - (2.0 if shared_writes else 1.0)).any()
    assert not (m - (2.0 if shared_writes else 1.0)).any()
    del m
