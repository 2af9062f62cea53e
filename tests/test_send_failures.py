"""A task that cannot be sent fails its call at once, with its own error, in every API.

Failures: an unpicklable argument, a temp folder that is a regular file,
``/proc``, ``/sys/kernel``, an unwritable folder, and no room anywhere for a
dump. Each is tried against every entry point of ``MemmappingPool`` and
``memshare.Parallel``; the bad item comes after good ones, so that with
``map`` chunks it is packed in the pool's task-feeding thread and with
``Parallel`` it is dispatched from joblib's callback thread.
"""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
from conftest import RETURN_AS, memshare_entries

import memshare
import memshare._lifetime._folders
from memshare import MemmappingPool, Parallel, SharedMemoryFullError, UnpicklableArgumentError, delayed

BIG = 300_000  # float64 elements: 2.4 MB, above the default max_nbytes


def one(_):
    return 1


def one_of_two(_, __):
    return 1


def _items(bad):
    return [1] * 6 + [bad] + [1] * 5


def _call_pool(pool, entry, bad):
    items = _items(bad)
    if entry == "apply":
        return pool.apply(one, (bad,))
    if entry == "apply_async":
        return pool.apply_async(one, (bad,)).get(timeout=60)
    if entry == "map":
        return pool.map(one, items, chunksize=2)
    if entry == "map_async":
        return pool.map_async(one, items, chunksize=2).get(timeout=60)
    if entry == "starmap":
        return pool.starmap(one_of_two, [(item, 0) for item in items], chunksize=2)
    if entry == "starmap_async":
        return pool.starmap_async(one_of_two, [(item, 0) for item in items], chunksize=2).get(timeout=60)
    if entry == "imap":
        return list(pool.imap(one, iter(items), chunksize=2))
    if entry == "imap_unordered":
        return list(pool.imap_unordered(one, iter(items), chunksize=2))
    if entry == "map_progress":
        return pool.map(one, items, progress=True)
    raise AssertionError(entry)


POOL_ENTRIES = [
    "apply",
    "apply_async",
    "map",
    "map_async",
    "starmap",
    "starmap_async",
    "imap",
    "imap_unordered",
    "map_progress",
]
PARALLEL_ENTRIES = RETURN_AS
FAILURES = ["unpicklable", "regular_file", "proc", "sys_kernel", "unwritable", "no_room"]


@pytest.fixture
def failure(request, tmp_path, shm_dir, monkeypatch):
    """(temp_folder, bad item, expected exception type, expected errno or None) for the failure named."""
    name = request.param
    big = np.ones(BIG)
    if name == "unpicklable":
        return None, threading.Lock(), UnpicklableArgumentError, None
    if name == "regular_file":
        path = tmp_path / "a-file"
        path.write_text("not a folder")
        return str(path), big, NotADirectoryError, errno.ENOTDIR
    if name in ("proc", "sys_kernel"):
        path = "/proc" if name == "proc" else "/sys/kernel"
        if not os.path.isdir(path):
            pytest.skip(f"{path} exists on Linux only")
        if name == "proc":
            return path, big, FileNotFoundError, errno.ENOENT
        return path, big, PermissionError, None  # EPERM for root, EACCES otherwise
    if name == "unwritable":
        path, kind, code = request.getfixturevalue("unwritable_dir")
        return str(path), big, kind, code
    if name == "no_room":

        def no_room(fd, offset, nbytes):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(memshare._lifetime._folders, "reserve", no_room)
        return None, big, SharedMemoryFullError, errno.ENOSPC
    raise AssertionError(name)


def _check(error_info, kind, code):
    assert isinstance(error_info.value, kind)
    if code is not None:
        assert error_info.value.errno == code
    if isinstance(error_info.value, OSError) and code != errno.ENOSPC:
        assert "temp_folder" in str(error_info.value)  # names the fix


@pytest.mark.timeout(120)
@pytest.mark.parametrize("failure", FAILURES, indirect=True)
def test_pool_entry_points_raise_promptly_and_stay_usable(failure, shm_dir):
    folder, bad, kind, code = failure
    with MemmappingPool(2, temp_folder=folder) as pool:
        for entry in POOL_ENTRIES:
            with pytest.raises(kind) as info:
                _call_pool(pool, entry, bad)
            _check(info, kind, code)
            assert pool.map(one, range(4)) == [1] * 4, entry  # still usable
    assert memshare_entries(shm_dir) == []
    if folder is not None and os.path.isdir(folder):
        assert memshare_entries(folder) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("return_as", PARALLEL_ENTRIES)
@pytest.mark.parametrize("failure", FAILURES, indirect=True)
def test_parallel_raises_promptly_whatever_the_batch(failure, return_as, shm_dir):
    folder, bad, kind, code = failure
    for items in ([bad], _items(bad)):  # dispatched first, and from a callback thread
        parallel = Parallel(n_jobs=2, temp_folder=folder, batch_size=1, return_as=return_as)
        with pytest.raises(kind) as info:
            list(parallel(delayed(one)(x) for x in items))
        _check(info, kind, code)
    assert memshare_entries(shm_dir) == []
    if folder is not None and os.path.isdir(folder):
        assert memshare_entries(folder) == []


@pytest.mark.timeout(60)
def test_a_failing_iterable_fails_imap_at_its_position_and_keeps_its_exception(shm_dir):
    class Broken(Exception):
        def __init__(self, a, b):  # not rebuildable from its args: must not be pickled
            super().__init__(f"{a}{b}")

    error = Broken("x", "y")

    def items():
        yield np.ones(BIG)
        yield 1
        raise error

    with MemmappingPool(2) as pool:
        results = pool.imap(one, items())
        assert next(results) == 1 and next(results) == 1
        with pytest.raises(Broken) as info:
            next(results)
        assert info.value is error
    assert memshare_entries(shm_dir) == []


@pytest.mark.timeout(60)
def test_the_rest_of_a_failed_map_is_not_run(shm_dir, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    items = [str(marks / f"{i}") for i in range(20)]
    items[3] = threading.Lock()
    with MemmappingPool(2) as pool:
        with pytest.raises(UnpicklableArgumentError):
            pool.map(touch, items, chunksize=1)
    assert len(os.listdir(marks)) <= 3  # only the items before the failure could have run


def touch(path):
    open(path, "w").close()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="/proc exists on Linux only")
def test_proc_as_a_folder_gives_a_short_clear_error():
    with pytest.raises(FileNotFoundError) as info:
        memshare._lifetime._folders.ensure_private_dir("/proc/memshare-test")
    assert "'/proc'" in str(info.value) and "temp_folder" in str(info.value)
    assert len(info.traceback) < 5  # no recursion
