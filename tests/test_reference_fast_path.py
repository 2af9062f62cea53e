"""References to memshare's own mappings come from what is on record, not from system calls.

A shared array, a broadcast and a worker's input are mappings that
``_mapping.map_file`` made from an open descriptor: it records their file,
and ``_backing.find_backing`` names that file from the record (no ``stat`` nor
``readlink`` for a memfd this process holds; one ``stat`` otherwise). Here:
the record gives the reference a full look would, it is not trusted when the
path names another file or the array is gone, and repeated sends and receipts
cost no system call in the parent and no new mapping in a worker. Counted,
never timed (``benchmarks/many_broadcasts.py`` times them).
"""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest

import memshare
from memshare._config import Settings
from memshare._lifetime import _memfd
from memshare._parent._session import Session
from memshare._transport import _backing, _identity, _mapping
from memshare._transport._mapping import MappingCache


def _slow_backing(array, monkeypatch, **options):
    """find_backing with nothing on record: every fact from the file system, as before the records."""
    with monkeypatch.context() as patch:
        patch.setattr(_backing, "_mapped_files", _identity.IdentityTable())
        patch.setattr(_backing, "_found", _identity.IdentityTable())
        return _backing.find_backing(array, **options)


class _Calls:
    """Counts this thread's os.stat and os.readlink calls (the system calls find_backing makes) while installed.

    Other threads' calls are not counted: a mapping cache's pruner, started by
    an earlier test of the process, stats its files every few hundredths of a
    second, and more often as the machine is busier.
    """

    def __init__(self, monkeypatch):
        self.stat = self.readlink = 0
        real_stat, real_readlink = os.stat, os.readlink
        thread = threading.get_ident()

        def stat(*args, **kwargs):
            self.stat += threading.get_ident() == thread
            return real_stat(*args, **kwargs)

        def readlink(*args, **kwargs):
            self.readlink += threading.get_ident() == thread
            return real_readlink(*args, **kwargs)

        monkeypatch.setattr(os, "stat", stat)
        monkeypatch.setattr(os, "readlink", readlink)


def _views(x):
    return [x, x[3:], x[::-2], x.T, x[1:, 2:].T, x.view(np.uint8), x[0], x[:, 1]]


def test_the_record_gives_the_reference_a_full_look_gives(mechanism, monkeypatch):
    x = memshare.zeros((6, 8), dtype=np.float64)
    shared = memshare.broadcast({"k": list(range(5))})
    read_only = x[2:]
    read_only.flags.writeable = False
    for view in [*_views(x), read_only, shared._data]:
        fast = _backing.find_backing(view)
        assert fast is not None
        assert fast == _slow_backing(view, monkeypatch)
        assert _backing.find_backing(view) == fast  # remembered: the same again
    assert _backing.find_backing(read_only).mode == "r"


def test_a_remembered_reference_follows_the_arrays_changes(monkeypatch):
    """Shape, strides, dtype and the writeable flag of an array can change in place: the reference follows."""
    x = memshare.zeros((4, 6), dtype=np.int32)
    first = _backing.find_backing(x)
    x.shape = (6, 4)
    assert _backing.find_backing(x) == _slow_backing(x, monkeypatch) != first
    assert _backing.find_backing(x).shape == (6, 4)
    x.flags.writeable = False
    assert _backing.find_backing(x).mode == "r"
    assert _backing.find_backing(x) == _slow_backing(x, monkeypatch)
    x.dtype = np.uint32
    assert _backing.find_backing(x).dtype == np.uint32
    assert _backing.find_backing(x) == _slow_backing(x, monkeypatch)


def test_a_replaced_named_file_is_not_named(tmp_path, monkeypatch):
    """A mapping whose path now names another file has no reference: the file is not its memory."""
    previous = _memfd.decision()
    _memfd.set_decision_for_tests(False, "tests: named files")
    try:
        x = memshare.full((1000,), 7, dtype=np.int64)
    finally:
        _memfd.set_decision_for_tests(previous.in_memory, previous.reason)
    path = _backing.find_backing(x).path
    other = f"{path}.other"
    with open(other, "wb") as new:
        new.write(np.zeros(1000, np.int64).tobytes())
    os.replace(other, path)
    # Found through the record, and with nothing on record: neither names the new file.
    assert _backing.find_backing(x) is None
    assert _backing.find_backing(x[10:]) is None


def test_a_memfd_number_another_file_took_is_not_named():
    """A memfd closed under a live mapping (only at exit, for a shared array) whose number names another file now."""
    if not _memfd.decision().in_memory:
        pytest.skip("memfds are not usable here")
    x = memshare.full((1000,), 7, dtype=np.int64)
    ref = _backing.find_backing(x)
    number = int(ref.path.rsplit("/", 1)[1])
    _memfd.release(ref.path)  # x's mapping keeps the file; its path names nothing now
    assert _backing.find_backing(x) is None
    other = os.memfd_create("memshare-shared-0123456789abcdef", os.MFD_CLOEXEC)  # often takes the number itself
    try:
        if other != number:
            os.dup2(other, number)
        assert os.stat(ref.path).st_ino != ref.inode
        assert _backing.find_backing(x) is None
        assert _backing.find_backing(x[1:]) is None
    finally:
        os.close(number)
        if other != number:
            os.close(other)
    # Collected now, while its number is free: its finalizer's release must not close a later file's memfd.
    del x
    gc.collect()


def test_records_go_with_their_arrays():
    gc.collect()
    before = len(_backing._found._items), len(_backing._mapped_files._items)
    x = memshare.zeros((100,))
    view = x[5:]
    assert _backing.find_backing(view) is not None
    assert len(_backing._found._items) == before[0] + 1
    assert len(_backing._mapped_files._items) == before[1] + 1
    del x, view
    gc.collect()
    assert (len(_backing._found._items), len(_backing._mapped_files._items)) == before


def test_a_shared_array_costs_no_system_call_per_task(monkeypatch):
    """Packing tasks that pass memfd-backed shared arrays and broadcasts stats and readlinks nothing."""
    if not _memfd.decision().in_memory:
        pytest.skip("memfds are not usable here")
    x = memshare.zeros((1000,))
    shared = [memshare.broadcast({"k": i}) for i in range(20)]
    session = Session(Settings.from_user("1M", "r", None, None))
    try:
        session.pack_task(len, (x,))  # the session's own start: its folder, its inbox
        calls = _Calls(monkeypatch)
        for item in shared:
            session.pack_task(len, (x[1:], item))
        monkeypatch.undo()
        assert (calls.stat, calls.readlink) == (0, 0)
    finally:
        session.close()


def test_named_files_cost_one_stat_per_array(monkeypatch):
    previous = _memfd.decision()
    _memfd.set_decision_for_tests(False, "tests: named files")
    try:
        x = memshare.zeros((1000,))
    finally:
        _memfd.set_decision_for_tests(previous.in_memory, previous.reason)
    _backing.find_backing(x)
    calls = _Calls(monkeypatch)
    for _ in range(10):
        assert _backing.find_backing(x) is not None
    monkeypatch.undo()
    assert (calls.stat, calls.readlink) == (10, 0)


def test_a_mapping_held_elsewhere_is_viewed_not_mapped_again(monkeypatch):
    x = memshare.full((1000,), 3.0)
    ref = _backing.find_backing(x)
    cache = MappingCache()
    made = []
    real = _mapping.map_file
    monkeypatch.setattr(_mapping, "map_file", lambda r: made.append(r) or real(r))
    held = cache.array(ref)
    cache.forget(ref.path, ref.device, ref.inode)  # as a broadcast's copy does: it holds the mapping
    again = [cache.array(ref) for _ in range(5)]
    assert len(made) == 1
    assert all(np.shares_memory(held, view) and view[7] == 3.0 for view in again)
    assert len(cache) == 0  # not cached again: the holder keeps it
    # Once nothing holds it, a receipt maps the file again.
    del held, again
    gc.collect()
    cache.array(ref)
    assert len(made) == 2


def _count_mappings(_):
    """From now on in this worker, count the files mapped."""
    from memshare._transport import _mapping as mapping

    counts = {"mapped": 0}
    real = mapping.map_file

    def counted(ref):
        counts["mapped"] += 1
        return real(ref)

    mapping.map_file = counted
    globals()["_mapped"] = counts
    return os.getpid()


def _mapped_so_far(_):
    return os.getpid(), globals()["_mapped"]["mapped"]


def _size(shared):
    return len(shared.value)


def test_a_held_broadcast_is_not_mapped_again_per_task():
    shared = [memshare.broadcast({"k": i}) for i in range(5)]
    with memshare.MemmappingPool(1) as pool:
        assert pool.map(_size, shared, chunksize=1) == [1] * 5
        pid = pool.apply(_count_mappings, (0,))
        for _ in range(10):
            assert pool.map(_size, shared, chunksize=1) == [1] * 5
        assert pool.apply(_mapped_so_far, (0,)) == (pid, 0)
        pool.close()
        pool.join()


def test_a_small_broadcast_maps_nothing_even_on_its_first_receipt():
    """A broadcast of at most a page travels in the stream too: a worker's first receipt unpickles it from there."""
    from memshare._payload._broadcast import INLINE_NBYTES

    small = [memshare.broadcast({"k": i}) for i in range(5)]
    large = memshare.broadcast({"k": list(range(INLINE_NBYTES))})
    assert all(item.nbytes <= INLINE_NBYTES for item in small) and large.nbytes > INLINE_NBYTES
    with memshare.MemmappingPool(1) as pool:
        assert pool.apply(_size, (memshare.broadcast({"k": 0}),)) == 1  # the worker maps the parent's drop log once
        pid = pool.apply(_count_mappings, (0,))
        assert pool.map(_size, small, chunksize=1) == [1] * 5
        assert pool.apply(_mapped_so_far, (0,)) == (pid, 0)
        for _ in range(3):  # a large one is mapped once, on its first receipt
            assert pool.apply(_size, (large,)) == 1
        assert pool.apply(_mapped_so_far, (0,)) == (pid, 1)
        pool.close()
        pool.join()


def test_sending_a_broadcast_routes_no_array(monkeypatch):
    """The parent sends a broadcast as its token and its file, found once per process: no route per task."""
    from memshare._parent import _arguments

    routed = []
    real = _arguments.input_route
    monkeypatch.setattr(_arguments, "input_route", lambda array, *a, **k: routed.append(array) or real(array, *a, **k))
    shared = memshare.broadcast({"k": list(range(10))})
    session = Session(Settings.from_user("1M", "r", None, None))
    try:
        for _ in range(10):
            session.task_done(session.pack_task(_size, (shared,)).token)
        assert routed == []
        assert session.stats.as_dict()["arrays_referenced"] == 1  # counted once, as a shared array is
    finally:
        session.close()


def test_a_broadcast_dropped_after_its_task_was_packed_lives_until_the_task_is_done():
    from memshare._payload._broadcast import sent_by_reference
    from memshare._transport._refs import is_file

    shared = memshare.broadcast({"k": list(range(10))})
    ref = sent_by_reference(shared).ref
    session = Session(Settings.from_user("1M", "r", None, None))
    try:
        task = session.pack_task(_size, (shared,))
        del shared
        gc.collect()
        assert is_file(ref.path, (ref.device, ref.inode))  # the task holds it: a worker may not have read it yet
        session.task_done(task.token)
        gc.collect()
        assert not is_file(ref.path, (ref.device, ref.inode))
    finally:
        session.close()
