"""Adopted results hold no descriptor in the parent: any number of them fit under a descriptor limit.

A mapping does not need its file's descriptor once it exists (the kernel keeps
the file alive while it is mapped), but Python's ``mmap.mmap`` keeps a
duplicate until the map is closed. The parent maps each result through
``_mapping.map_descriptor`` instead: open, map, close.
"""

from __future__ import annotations

import gc
import mmap
import os
import sys

import numpy as np
import pytest
from conftest import run_script

import memshare._transport._mapping as mapping
from memshare import Parallel, delayed
from memshare._transport._mapping import map_descriptor

PAGE = mmap.PAGESIZE


def many_small(i, count=100, n=1024):
    return [np.full(n, float(i)) for _ in range(count)]


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def mapped_paths(addresses) -> list:
    """The path column of each line of /proc/self/maps that contains one of ``addresses`` ('' if anonymous)."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if any(low <= address < high for address in addresses):
                found.append(fields[5].strip() if len(fields) > 5 else "")
    return found


def address_of(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


# Which ways of mapping this interpreter offers: ctypes always; mmap(trackfd=False) from Python 3.13.
WAYS = ["ctypes"] + (["trackfd"] if sys.version_info >= (3, 13) else [])


@pytest.fixture(params=WAYS)
def way(request, monkeypatch):
    monkeypatch.setattr(mapping, "TRACKFD", request.param == "trackfd")
    return request.param


@pytest.mark.parametrize("memfd", ["1", "0"], ids=["memfd", "named"])
def test_many_results_under_a_descriptor_limit_in_the_parent(memfd):
    # The limit is lowered in the parent only, once its workers run: what is
    # checked is the parent's adoption of 1200 results, not the workers' side.
    script = """
        import os, resource
        import numpy as np
        from memshare import Parallel, delayed

        def many(i):
            return [np.full(1024, float(i)) for _ in range(100)]

        with Parallel(n_jobs=2, max_nbytes="1K") as parallel:
            parallel(delayed(np.sum)(np.ones(1)) for _ in range(4))  # the workers start
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
            before = len(os.listdir("/proc/self/fd"))
            out = parallel(delayed(many)(i) for i in range(12))
            after = len(os.listdir("/proc/self/fd"))
        assert [len(arrays) for arrays in out] == [100] * 12
        assert all(type(a) is np.ndarray and a.flags.writeable for arrays in out for a in arrays)
        assert all((a == i).all() for i, arrays in enumerate(out) for a in arrays)
        print("descriptors", before, after)
    """
    result = run_script(script, env={"MEMSHARE_MEMFD": memfd}, timeout=240)
    before, after = (int(x) for x in result.stdout.split()[-2:])
    assert after - before < 50, f"{after - before} descriptors more while 1200 results are alive"


@pytest.mark.parametrize("memfd", ["1", "0"], ids=["memfd", "named"])
def test_adopted_results_keep_no_descriptor_and_go_with_their_arrays(request, monkeypatch, way, memfd):
    monkeypatch.setenv("MEMSHARE_MEMFD", memfd)
    if memfd == "0":
        request.getfixturevalue("shm_dir")  # named files in a folder of the test's own (one chosen keeps names)
    with Parallel(n_jobs=2, max_nbytes="1K") as parallel:
        parallel(delayed(np.sum)(np.ones(1)) for _ in range(4))  # the workers start
        before = open_descriptors()
        out = parallel(delayed(many_small)(i, 20, 8192) for i in range(4))
        after = open_descriptors()
    arrays = [a for batch in out for a in batch]
    assert len(arrays) == 80
    assert after - before < 20, f"{after - before} descriptors more while 80 results are alive"
    for i, batch in enumerate(out):
        for a in batch:
            assert type(a) is np.ndarray and a.flags.writeable and a.flags.c_contiguous
            assert (a == i).all()
    arrays[0][:] = -1.0  # writable, and writes stay in that array
    assert (arrays[0] == -1.0).all() and (arrays[1] == 0.0).all()
    addresses = [address_of(a) for a in arrays]
    paths = mapped_paths(addresses)
    kind = "memshare-result" if memfd == "1" else "/result-"
    assert len(paths) >= 1 and all(kind in path for path in paths), paths
    del out, arrays, batch, a
    gc.collect()
    assert not [path for path in mapped_paths(addresses) if kind in path]


def test_map_descriptor_keeps_no_descriptor_and_unmaps_with_the_array(tmp_path, way):
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * (3 * PAGE // 256))
    before = open_descriptors()
    fd = os.open(path, os.O_RDWR)
    try:
        raw = map_descriptor(fd, 3 * PAGE, "r+")
    finally:
        os.close(fd)
    assert open_descriptors() == before
    assert type(raw) is np.ndarray and raw.dtype == np.uint8 and raw.shape == (3 * PAGE,)
    assert raw.flags.writeable and raw[:4].tolist() == [0, 1, 2, 3]
    raw[0] = 200  # shared: the file sees it
    assert path.read_bytes()[0] == 200
    view = np.ndarray((PAGE // 8,), np.float64, buffer=raw, offset=PAGE)
    address = address_of(raw)
    assert mapped_paths([address]) == [str(path)]
    del raw
    gc.collect()
    assert mapped_paths([address]) == [str(path)]  # a view keeps the mapping
    del view
    gc.collect()
    assert str(path) not in mapped_paths([address])


@pytest.mark.parametrize("mode", ["r", "c"])
def test_map_descriptor_read_only_and_copy_on_write(tmp_path, way, mode):
    path = tmp_path / "data.bin"
    path.write_bytes(b"\x01" * PAGE)
    fd = os.open(path, os.O_RDONLY)
    try:
        raw = map_descriptor(fd, PAGE, mode)
    finally:
        os.close(fd)
    assert raw.sum() == PAGE
    if mode == "r":
        assert not raw.flags.writeable
        with pytest.raises(ValueError):
            raw[0] = 2
    else:
        raw[0] = 2  # a private copy: the file is unchanged
        assert raw[0] == 2 and path.read_bytes()[0] == 1


def test_map_descriptor_of_nothing_and_bad_arguments(tmp_path, way):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert map_descriptor(fd, 0, "r").shape == (0,)
        with pytest.raises(ValueError, match="mode"):
            map_descriptor(fd, PAGE, "w+")
        with pytest.raises(ValueError, match="length"):
            map_descriptor(fd, -1, "r")
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        map_descriptor(fd, PAGE, "r")  # closed: EBADF, not a crash
