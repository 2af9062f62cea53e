"""Mapping safely: the user's own symbolic links, only the session's result files, and the C helper's checks."""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import pickle
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import total

import memshare
from memshare import MemmappingPool, Parallel, delayed
from memshare._config import Settings
from memshare._lifetime._folders import FolderPair
from memshare._lifetime._owners import Owner, new_folder_name
from memshare._parent._adopt import adopt_result, restore
from memshare._parent._session import Session
from memshare._transport._protocol import Outcome
from memshare._transport._refs import RESULT, ArrayRef

PAGE = mmap.PAGESIZE

try:
    from memshare._parent import _remap
except ImportError:  # built without a C compiler
    _remap = None


# -- the user's own symbolic links --------------------------------------------


@pytest.fixture
def linked_memmap(tmp_path):
    """A user's np.memmap opened through a symbolic link ``link.bin -> real.bin``."""
    real, link = tmp_path / "real.bin", tmp_path / "link.bin"
    np.arange(100_000, dtype=np.float64).tofile(real)
    link.symlink_to(real)
    return link, np.memmap(str(link), dtype=np.float64, mode="r+")  # a Path would be resolved by numpy


def tail_of(a):
    return a[10:]


def open_and_return_tail(path):
    return np.memmap(path, dtype=np.float64, mode="r+")[10:]


def test_a_memmap_opened_through_a_link_is_an_input(shm_dir, linked_memmap):
    _, data = linked_memmap
    assert Parallel(n_jobs=2, max_nbytes=1)(delayed(total)(data) for _ in range(2)) == [float(data.sum())] * 2
    assert memshare.last_call_stats()["arrays_referenced"] == 1


def test_a_view_of_a_linked_memmap_comes_back_as_that_memory(shm_dir, linked_memmap):
    link, data = linked_memmap
    (back,) = Parallel(n_jobs=2, max_nbytes=1)(delayed(tail_of)(data) for _ in range(1))
    np.testing.assert_array_equal(back, data[10:])
    back[0] = -1.0  # the same file: the user's memmap sees it
    assert data[10] == -1.0
    # A result the worker opened through the link itself.
    with MemmappingPool(2, max_nbytes=1) as pool:
        opened = pool.apply_async(open_and_return_tail, (str(link),)).get(timeout=60)
    assert isinstance(opened, np.memmap) and opened[0] == -1.0 and opened[1] == 11.0


def test_memshare_files_are_still_never_followed(shm_dir, tmp_path):
    # A link planted where a memshare result file would be is refused, not followed.
    folder = tmp_path / "shm" / new_folder_name(Owner.current())
    folder.mkdir(mode=0o700)
    target = tmp_path / "target.bin"
    target.write_bytes(b"\0" * PAGE)
    link = folder / "result-0123456789abcdef.bin"
    link.symlink_to(target)
    info = os.stat(target)
    ref = ArrayRef.in_file(
        str(link), info, kind=RESULT, mode="r+", offset=0, shape=(PAGE,), strides=(1,), dtype=np.dtype("u1")
    )
    pair = FolderPair(str(folder))
    with pytest.raises(OSError):
        adopt_result(ref, folder=pair)
    assert target.exists() and link.is_symlink()


# -- only the session's own result files are adopted --------------------------


@pytest.fixture
def two_sessions(tmp_path):
    """The folder pairs of two sessions, each with a fallback twin, under a temp base."""
    pairs = []
    for _ in range(2):
        name = new_folder_name(Owner.current())
        pair = FolderPair(str(tmp_path / "shm" / name), str(tmp_path / "disk" / f"{name}-disk"))
        for folder in (pair.primary, pair.fallback):
            os.makedirs(folder, mode=0o700)
        pairs.append(pair)
    return pairs


def result_file(folder: str, value: float, n: int = 1000) -> ArrayRef:
    path = os.path.join(folder, f"result-{os.urandom(8).hex()}.bin")
    np.full(n, value).tofile(path)
    return ArrayRef.in_file(
        path, os.stat(path), kind=RESULT, mode="r+", offset=0, shape=(n,), strides=(8,), dtype=np.dtype("f8")
    )


class _SlotZero(pickle.Pickler):
    """Pickles the string "slot" as slot 0, as a worker's result policy does with a large array."""

    def persistent_id(self, obj):
        return 0 if obj == "slot" else None


def outcome_naming(ref: ArrayRef) -> Outcome:
    """A successful outcome whose value is a list holding slot 0's array, which is at ``ref``."""
    buffer = io.BytesIO()
    _SlotZero(buffer, protocol=5).dump(["slot"])
    return Outcome(token=1, ok=True, stream=buffer.getvalue(), slots=(ref,))


@pytest.mark.parametrize("where", ["primary", "fallback"])
def test_a_result_file_of_another_session_is_refused_and_left_alone(two_sessions, where):
    mine, other = two_sessions
    ref = result_file(getattr(other, where), 5.0)
    ok, error = restore(outcome_naming(ref), folder=mine)
    assert not ok and isinstance(error, PermissionError)
    assert "not in this call's folders" in str(error) and ref.path in str(error)
    assert os.path.exists(ref.path)  # not unlinked
    assert np.fromfile(ref.path).sum() == 5000.0


def test_a_path_through_a_link_to_another_session_is_refused(two_sessions, tmp_path):
    # The name looks like a memshare folder; the directory it reaches is another session's.
    mine, other = two_sessions
    alias = tmp_path / "shm" / new_folder_name(Owner.current())
    alias.symlink_to(other.primary)
    ref = result_file(other.primary, 2.0)
    aliased = ArrayRef.in_file(
        str(alias / os.path.basename(ref.path)),
        os.stat(ref.path),
        kind=RESULT,
        mode="r+",
        offset=0,
        shape=ref.shape,
        strides=ref.strides,
        dtype=ref.dtype,
    )
    ok, error = restore(outcome_naming(aliased), folder=mine)
    assert not ok and isinstance(error, PermissionError)
    assert os.path.exists(ref.path)


@pytest.mark.parametrize("where", ["primary", "fallback"])
def test_a_result_file_of_the_session_is_adopted_and_unlinked(two_sessions, where):
    mine, _ = two_sessions
    ref = result_file(getattr(mine, where), 7.0)
    ok, value = restore(outcome_naming(ref), folder=mine)
    assert ok and type(value[0]) is np.ndarray and value[0].flags.writeable and value[0].sum() == 7000.0
    assert not os.path.exists(ref.path)


# -- the C helper checks its arguments before touching memory ------------------

needs_helper = pytest.mark.skipif(_remap is None, reason="memshare was built without its C helper")


@pytest.fixture
def pages(tmp_path):
    """Two pages of private anonymous memory filled with a pattern, and an empty file's descriptor."""
    memory = mmap.mmap(-1, 2 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pattern = bytes(range(251)) * (2 * PAGE // 251) + bytes(2 * PAGE % 251)
    memory[:] = pattern
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    fd = os.open(tmp_path / "file.bin", os.O_RDWR | os.O_CREAT, 0o600)
    yield memory, address, fd, pattern
    os.close(fd)
    memory.close()


BAD_ARGUMENTS = {
    "length not whole pages": lambda address, fd: (fd, 0, address, 100),
    "length zero": lambda address, fd: (fd, 0, address, 0),
    "length negative": lambda address, fd: (fd, 0, address, -PAGE),
    "address not page-aligned": lambda address, fd: (fd, 8, address + 8, PAGE),
    "offset not page-aligned": lambda address, fd: (fd, 8, address, PAGE),
    "offset negative": lambda address, fd: (fd, -PAGE, address, PAGE),
    "descriptor negative": lambda address, fd: (-1, 0, address, PAGE),
    "descriptor closed": lambda address, fd: (999_999, 0, address, PAGE),
}


@needs_helper
@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_the_c_helper_refuses_bad_arguments_before_touching_memory(pages, case):
    memory, address, fd, pattern = pages
    arguments = BAD_ARGUMENTS[case](address, fd)
    with pytest.raises(ValueError, match="memshare"):
        _remap.copy_then_remap(*arguments)
    assert memory[:] == pattern  # untouched
    assert os.fstat(fd).st_size == 0  # nothing written


@needs_helper
def test_the_c_helper_still_does_its_job(pages):
    memory, address, fd, pattern = pages
    _remap.copy_then_remap(fd, 0, address, 2 * PAGE)
    assert memory[:] == pattern and os.pread(fd, 2 * PAGE, 0) == pattern
    memory[0:1] = b"\xff"  # a private copy of the first page: the file keeps its bytes
    assert os.pread(fd, 1, 0) == pattern[0:1] and memory[0:1] == b"\xff"


@pytest.mark.parametrize("memfd", ["1", "0"], ids=["memfd", "named"])
def test_a_session_refuses_another_sessions_result_file(shm_dir, monkeypatch, memfd):
    monkeypatch.setenv("MEMSHARE_MEMFD", memfd)
    mine, other = Session(Settings(max_nbytes=1024)), Session(Settings(max_nbytes=1024))
    try:
        os.makedirs(other.folder.pair.primary, mode=0o700, exist_ok=True)
        ref = result_file(other.folder.pair.primary, 4.0)
        ok, error = mine.finish(outcome_naming(ref))
        assert not ok and isinstance(error, PermissionError) and "not in this call's folders" in str(error)
        assert os.path.exists(ref.path) and np.fromfile(ref.path).sum() == 4000.0
        os.makedirs(mine.folder.pair.primary, mode=0o700, exist_ok=True)
        own = result_file(mine.folder.pair.primary, 3.0)
        ok, value = mine.finish(outcome_naming(own))
        assert ok and value[0].sum() == 3000.0 and not os.path.exists(own.path)
    finally:
        mine.close()
        other.close()


CRASH_AFTER_A_MOVE = """
import ctypes, faulthandler, mmap, os, sys, tempfile
from memshare._parent import _remap
if sys.argv[1] == "before":
    faulthandler.enable()
memory = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
memory[:4] = b"kept"
fd, path = tempfile.mkstemp()
os.unlink(path)
_remap.copy_then_remap(fd, 0, ctypes.addressof(ctypes.c_char.from_buffer(memory)), mmap.PAGESIZE)
assert memory[:4] == b"kept"
if sys.argv[1] == "after":
    faulthandler.enable()
print("moved", flush=True)
ctypes.string_at(1)  # a real crash: reading address 1
"""


@needs_helper
@pytest.mark.parametrize("faulthandler", ["none", "before", "after"])
def test_a_real_crash_after_a_move_still_crashes_as_before(faulthandler):
    # The helper's SIGSEGV handler, left in place after a move, passes every
    # fault outside a moving range on to the handler that was there before.
    run = subprocess.run(
        [sys.executable, "-c", CRASH_AFTER_A_MOVE, faulthandler], capture_output=True, text=True, timeout=60
    )
    assert run.stdout == "moved\n"
    assert run.returncode == -signal.SIGSEGV, run.stderr
    assert ("Fatal Python error: Segmentation fault" in run.stderr) == (faulthandler != "none")
