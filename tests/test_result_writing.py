"""How a worker writes large results: freeing them as they go, and moving them when room runs out.

These tests run the worker's side (``run_task``) in this process, so that
they can look at the worker's memory and files directly; the parent's side
(``restore``) then adopts the results as it would from a real worker.
"""

import errno
import os
import tempfile
import warnings
import weakref

import cloudpickle
import numpy as np
import pandas as pd
import pytest
from conftest import files_under, memshare_entries, mount_small_tmpfs, unmount

import memshare
import memshare._lifetime._folders as folders_module
import memshare._worker._result_files as result_files
from memshare._config import Settings
from memshare._lifetime._folders import FolderPair
from memshare._lifetime._owners import Owner, new_folder_name
from memshare._parent._adopt import restore
from memshare._parent._session import Session
from memshare._transport._dumping import CHUNK_BYTES
from memshare._transport._protocol import ResultSpec, Task
from memshare._worker._run import run_task

N = 3 * CHUNK_BYTES // 8 + 1000  # float64 elements: a few pieces, the last one partial

# Arrays a task keeps after returning them, reachable by reference from the worker's module state.
kept_in_worker = []


def ones(n):
    return np.ones(n)


def fortran(n):
    return np.asfortranarray(np.arange(float(n)).reshape(-1, 8))


def frame_and_dict(n):
    return {"frame": pd.DataFrame({"x": np.arange(float(n))}), "more": [np.full(n, 2.0)]}


def kept(n):
    array = np.full(n, 3.0)
    kept_in_worker.append(array)
    return array


def weakly_kept(n):
    array = np.full(n, 3.0)
    kept_in_worker.append(weakref.ref(array))
    return array


def whole_and_view(n):
    array = np.full(n, 3.0)
    return array, array[::2]


def view_of_kept(n):
    array = np.full(n, 3.0)
    kept_in_worker.append(array)
    return array[1:]


@pytest.fixture
def folders(tmp_path):
    name = new_folder_name(Owner.current())  # a real folder name: the parent only adopts files in such folders
    pair = FolderPair(str(tmp_path / "shm" / name), str(tmp_path / "disk" / f"{name}-disk"))
    yield pair
    for folder in (pair.primary, pair.fallback):
        assert not os.path.isdir(folder) or os.listdir(folder) == [], "a result file was left behind"


@pytest.fixture
def released(monkeypatch):
    """The lengths of memory the worker gave back, in the order it did."""
    lengths = []
    real = result_files.release_pages

    def record(address, length):
        lengths.append(length)
        real(address, length)

    monkeypatch.setattr(result_files, "release_pages", record)
    yield lengths
    kept_in_worker.clear()


def run_in_this_process(folders, func, *args):
    """Run ``func(*args)`` as a worker would, then adopt its outcome as the parent would."""
    task = Task(token=1, stream=cloudpickle.dumps((func, args, {})), results=ResultSpec(folders, 1024**2))
    outcome = run_task(task)
    ok, value = restore(outcome)
    if not ok:
        raise value
    return outcome, value


@pytest.mark.parametrize("func", [ones, fortran, frame_and_dict])
def test_results_only_memshare_holds_are_freed_as_they_are_written(folders, released, func):
    outcome, value = run_in_this_process(folders, func, N)
    files = outcome.result_files()
    assert len(files) >= 1
    assert sum(released) >= 0.99 * sum(ref.nbytes for ref in files)  # all but the partial pages at the ends
    assert max(released) <= CHUNK_BYTES  # piece by piece, not at the end
    expected = func(N)
    if isinstance(expected, dict):
        pd.testing.assert_frame_equal(value["frame"], expected["frame"])
        np.testing.assert_array_equal(value["more"][0], expected["more"][0])
    else:
        assert value.flags.f_contiguous == expected.flags.f_contiguous
        np.testing.assert_array_equal(value, expected)


@pytest.mark.parametrize("func", [kept, weakly_kept, view_of_kept, whole_and_view])
def test_results_the_worker_can_still_reach_are_left_intact(folders, released, func):
    outcome, value = run_in_this_process(folders, func, N)
    assert released == []
    for item in kept_in_worker:
        array = item() if isinstance(item, weakref.ref) else item
        if array is not None:
            assert array.min() == array.max() == 3.0  # still the worker's data, not zeroed pages
    for array in value if isinstance(value, tuple) else (value,):
        assert array.min() == array.max() == 3.0  # the view was written from intact memory


def test_the_worker_holds_a_result_about_once_while_writing_it(folders, monkeypatch):
    """Measured: the worker's private memory plus the result file, at every piece."""
    samples = []
    real = result_files.release_pages

    def sample(address, length):
        real(address, length)
        files = [os.path.join(folders.primary, name) for name in os.listdir(folders.primary)]
        samples.append(_rss_anon() + sum(os.stat(path).st_blocks * 512 for path in files))

    monkeypatch.setattr(result_files, "release_pages", sample)
    nbytes = 8 * CHUNK_BYTES
    before = _rss_anon()
    outcome, value = run_in_this_process(folders, ones, nbytes // 8)
    assert [ref.nbytes for ref in outcome.result_files()] == [nbytes] and len(samples) >= 8
    # Written whole and then dropped, it would be 2 x nbytes at the last piece.
    assert max(samples) - before < nbytes + 2 * CHUNK_BYTES
    assert value.sum() == nbytes // 8


def test_a_result_moves_to_the_fallback_when_room_runs_out_midway(folders, released, monkeypatch):
    real_reserve = result_files.reserve
    calls = []

    def full_after_two_pieces(fd, offset, nbytes):
        calls.append(offset)
        if os.readlink(f"/proc/self/fd/{fd}").startswith(os.path.realpath(folders.primary)) and len(calls) > 2:
            raise OSError(errno.ENOSPC, "no space left")
        real_reserve(fd, offset, nbytes)

    monkeypatch.setattr(result_files, "reserve", full_after_two_pieces)
    monkeypatch.setattr(folders_module, "reserve", full_after_two_pieces)
    with warnings.catch_warnings():
        # The worker's stderr is out of the caller's sight: the parent warns (see below).
        warnings.simplefilter("error", memshare.SharedMemoryFallbackWarning)
        outcome, value = run_in_this_process(folders, ones, N)
    (moved,) = outcome.slots
    assert moved.path.startswith(folders.fallback) and moved.nbytes == N * 8  # the first file is gone (fixture)
    np.testing.assert_array_equal(value, np.ones(N))  # the pieces written before the move were copied
    assert sum(released) >= 0.99 * N * 8  # released before and after the move


def no_room_after(pieces):
    """A fake ``reserve`` that finds every file system full after ``pieces`` reservations."""
    calls = []

    def reserve(fd, offset, nbytes):
        calls.append(offset)
        if len(calls) > pieces:
            raise OSError(errno.ENOSPC, "no space left")
        folders_module.os.posix_fallocate(fd, offset, nbytes)

    return reserve


@pytest.mark.parametrize("pieces", [0, 2])
@pytest.mark.parametrize("func", [ones, fortran, whole_and_view])
def test_a_result_that_fits_in_no_file_comes_back_by_value(folders, released, monkeypatch, pieces, func):
    reserve = no_room_after(pieces)
    monkeypatch.setattr(result_files, "reserve", reserve)
    monkeypatch.setattr(folders_module, "reserve", reserve)
    outcome, value = run_in_this_process(folders, func, N)
    assert outcome.by_value() and outcome.result_files() == []
    got, want = (value, func(N)) if isinstance(value, tuple) else ((value,), (func(N),))
    for got_array, want_array in zip(got, want):
        np.testing.assert_array_equal(got_array, want_array)  # pieces written before the failure were read back
    assert got[0].flags.f_contiguous == want[0].flags.f_contiguous  # the file's layout, Fortran for fortran()


def same_twice(n):
    array = np.full(n, 5.0)
    return {"first": array, "again": [array, array[::2]]}


def test_an_array_returned_twice_is_one_slot_and_comes_back_as_one_array(folders, released):
    outcome, value = run_in_this_process(folders, same_twice, N)
    assert len(outcome.slots) == 2  # the array, and its view: written once each
    assert value["first"] is value["again"][0]
    np.testing.assert_array_equal(value["again"][1], np.full(N, 5.0)[::2])


def _rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def full_of(n, value):
    return np.full(n, value)


@pytest.mark.version_independent
def test_results_bigger_than_a_small_shm_move_to_disk_with_their_values(small_tmpfs, monkeypatch):
    """Docker's 64 MB /dev/shm: two workers' 48 MB results cannot all fit, so some move midway."""
    monkeypatch.setenv("MEMSHARE_TEMP_FOLDER", str(small_tmpfs))
    n = 48 * 1024**2 // 8
    with pytest.warns(memshare.SharedMemoryFallbackWarning, match="on disk instead") as caught:
        out = memshare.Parallel(n_jobs=2)(memshare.delayed(full_of)(n, float(i)) for i in range(4))
    # In the parent, where the caller's filters apply; once per call. Only memshare's
    # warnings count: old joblib on a new Python adds DeprecationWarnings of its own.
    assert len([w for w in caught if issubclass(w.category, memshare.SharedMemoryFallbackWarning)]) == 1
    for i, array in enumerate(out):
        assert array.shape == (n,) and array[0] == array[n // 2] == array[-1] == float(i)
    stats = memshare.last_call_stats()
    assert stats["results_by_reference"] == 4
    assert stats["fallback_files"] >= 3  # the parent holds the results: at most one fits in 64 MB
    assert files_under(small_tmpfs) == []
    on_disk = memshare_entries(tempfile.gettempdir())
    assert [files for entry, files in on_disk if entry.startswith(f"memshare-{os.getpid()}-") and files] == []


def test_the_parent_warns_once_and_counts_results_that_went_to_disk_or_by_value(monkeypatch):
    session = Session(Settings(max_nbytes=1024**2))
    pair = session.folder.pair
    if pair.fallback is None:
        session.close()
        pytest.skip("shared memory and the temp dir are one file system here: there is no disk fallback")

    def no_room_in_shared_memory(fd, offset, nbytes):
        target = os.readlink(f"/proc/self/fd/{fd}")  # a file in the primary folder, or a memfd
        if target.startswith(os.path.realpath(pair.primary)) or target.startswith("/memfd:"):
            raise OSError(errno.ENOSPC, "no space left")
        os.posix_fallocate(fd, offset, nbytes)

    def run(func, *args):
        ok, value = session.finish(run_task(session.pack_task(func, args)))
        assert ok, value
        return value

    try:
        monkeypatch.setattr(result_files, "reserve", no_room_in_shared_memory)
        monkeypatch.setattr(folders_module, "reserve", no_room_in_shared_memory)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                np.testing.assert_array_equal(run(ones, N), np.ones(N))
        assert [str(w.message) for w in caught if "on disk instead" in str(w.message)] == [str(caught[0].message)]
        assert caught[0].category is memshare.SharedMemoryFallbackWarning and len(caught) == 1
        monkeypatch.setattr(result_files, "reserve", no_room_after(0))
        monkeypatch.setattr(folders_module, "reserve", no_room_after(0))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                np.testing.assert_array_equal(run(ones, N), np.ones(N))
        assert len(caught) == 1 and caught[0].category is memshare.SharedMemoryFallbackWarning
        assert "pickled back" in str(caught[0].message) and "shm-size" in str(caught[0].message)
    finally:
        session.close()
    stats = memshare.last_call_stats()
    assert (stats["fallback_files"], stats["results_pickled_no_room"], stats["results_by_reference"]) == (2, 2, 2)


@pytest.fixture
def small_disk_temp(tmp_path, monkeypatch):
    """The system temp dir, as the disk fallback sees it, on a 32 MB tmpfs (root only)."""
    mount_point = mount_small_tmpfs(tmp_path, "small-temp", "32m", "as the temp dir")
    monkeypatch.setattr(tempfile, "tempdir", str(mount_point))
    try:
        yield mount_point
    finally:
        monkeypatch.undo()
        unmount(mount_point)


@pytest.mark.version_independent
def test_results_too_big_for_shared_memory_and_disk_come_back_by_value(small_tmpfs, small_disk_temp, monkeypatch):
    """/dev/shm 64 MB, temp dir 32 MB, four 40 MiB results: joblib returns them, and so does memshare."""
    monkeypatch.setenv("MEMSHARE_TEMP_FOLDER", str(small_tmpfs))
    n = 40 * 1024**2 // 8
    with pytest.warns(memshare.SharedMemoryFallbackWarning, match="pickled back to the parent") as caught:
        out = memshare.Parallel(n_jobs=2)(memshare.delayed(full_of)(n, float(i)) for i in range(4))
    assert len([w for w in caught if "pickled back" in str(w.message)]) == 1
    for i, array in enumerate(out):
        assert array.shape == (n,) and array[0] == array[n // 2] == array[-1] == float(i)
    stats = memshare.last_call_stats()
    assert stats["results_pickled_no_room"] >= 2  # the parent holds the results: at most one file fits at a time
    assert stats["results_pickled_no_room"] + stats["results_by_reference"] == 4
    assert files_under(small_tmpfs) == files_under(small_disk_temp) == []
