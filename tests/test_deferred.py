"""The joblib backend packs a batch when loky sends it, not when joblib dispatches it."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from conftest import memfds_held, wait_until

import memshare
from memshare import Parallel, delayed
from memshare._config import Settings
from memshare._parent._session import Session
from memshare._worker._run import run_task

MIB = 1024**2

# Indices of the probes pickled so far in this process (the parent): a probe is pickled only when its
# task is packed.
_packed = set()
_packed_lock = threading.Lock()


def _probe_value(index):
    return index


class PackProbe:
    """An argument that notes, in the parent, when the task carrying it is packed."""

    def __init__(self, index):
        self.index = index

    def __reduce__(self):
        with _packed_lock:
            _packed.add(self.index)
        return _probe_value, (self.index,)


def wait_for_file(path, index, array):
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return index, float(array[0])


def test_batches_dispatched_ahead_are_not_packed_until_loky_sends_them(tmp_path):
    """pre_dispatch="all" hands joblib's 20 batches to the backend at once; only those loky sends are packed.

    Packing at dispatch pickled all 20 at once while the workers were still
    blocked on the first two. (The arguments are small: batches that write
    dumps wait for more, see the last test.)
    """
    gate = str(tmp_path / "go")
    _packed.clear()
    arrays = [np.full(1000, float(i)) for i in range(20)]
    results = []
    call = threading.Thread(
        target=lambda: results.extend(
            Parallel(n_jobs=2, pre_dispatch="all", batch_size=1)(
                delayed(wait_for_file)(gate, PackProbe(i), arrays[i]) for i in range(20)
            )
        )
    )
    call.start()
    try:
        # Two running, loky's call queue (workers + 1) full: five packed, maybe a sixth in the feeder.
        assert wait_until(lambda: len(_packed) >= 5, timeout=60)
        time.sleep(0.5)  # give an eager packer every chance to go on
        packed_while_blocked = len(_packed)
    finally:
        open(gate, "w").close()
        call.join(120)
    assert not call.is_alive()
    assert packed_while_blocked <= 8, sorted(_packed)
    assert results == [(i, float(i)) for i in range(20)]
    assert _packed == set(range(20))


class Unpicklable:
    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


def test_a_batch_that_cannot_be_packed_fails_with_its_own_error_and_the_call_goes_on_failing():
    with pytest.raises(memshare.UnpicklableArgumentError, match="refuses to be pickled"):
        Parallel(n_jobs=2)(delayed(len)(Unpicklable() if i == 5 else [i]) for i in range(10))
    # The backend is usable afterwards, and the next call's figures are its own.
    assert Parallel(n_jobs=2)(delayed(len)([i] * i) for i in range(4)) == [0, 1, 2, 3]


def _length(value):
    return len(value)


def test_an_object_used_again_after_its_first_task_finished_is_not_written_again():
    """Tasks are packed as they are sent: a later task may name an object whose only task is done."""
    table = {f"key-{i}": i for i in range(200_000)}  # about 3.5 MB pickled: an object dump
    session = Session(Settings.from_user("1M", "r", None, None))
    try:
        for _ in range(3):
            ok, value = session.finish(run_task(session.pack_task(_length, (table,))))
            assert ok and value == len(table)
        assert session.stats.objects_dumped == 1
    finally:
        session.close()


def test_single_use_object_dumps_do_not_pile_up():
    """Objects made anew for each task: only the few most recent finished dumps are kept."""
    session = Session(Settings.from_user("1M", "r", None, None))
    memfds_before = len(memfds_held())
    try:
        for i in range(8):
            table = {f"key-{i}-{j}": j for j in range(200_000)}
            ok, value = session.finish(run_task(session.pack_task(_length, (table,))))
            assert ok and value == len(table)
        assert session.stats.objects_dumped == 8
        kept = len(memfds_held()) - memfds_before
        folder = session.folder.pair.primary
        kept += len([name for name in os.listdir(folder) if name.startswith("dump-")]) if os.path.isdir(folder) else 0
        assert kept <= 2, kept
    finally:
        session.close()


def test_batches_with_new_dumps_wait_while_every_worker_and_the_queue_has_one(tmp_path):
    """A dict of its own for each task: packing stops at a running task per worker and one queued.

    loky's feeder blocks on the pipe once it has written a pickled batch no
    worker has read yet, so joblib holds one such dict pickled beyond the
    workers; without waiting, memshare packed and dumped every batch loky
    queued.
    """
    gate = str(tmp_path / "go")
    _packed.clear()
    tables = [{f"key-{j}": j + i for j in range(100_000)} for i in range(12)]  # about 1.7 MB pickled each
    results = []
    call = threading.Thread(
        target=lambda: results.extend(
            Parallel(n_jobs=2, pre_dispatch="all", batch_size=1)(
                delayed(wait_for_table)(gate, PackProbe(i), tables[i]) for i in range(12)
            )
        )
    )
    call.start()
    try:
        assert wait_until(lambda: len(_packed) >= 3, timeout=60)
        time.sleep(1.0)  # give the feeder every chance to go on
        packed_while_blocked = sorted(_packed)
    finally:
        open(gate, "w").close()
        call.join(120)
    assert not call.is_alive()
    assert packed_while_blocked == [0, 1, 2]
    assert results == [(i, i) for i in range(12)]
    assert memshare.last_call_stats()["objects_dumped"] == 12


def wait_for_table(path, index, table):
    wait_for_file(path, index, [0.0])
    return index, table["key-0"]


def test_every_buffer_of_an_argument_is_reused_after_its_first_task_finished():
    """A table with four large columns: all four dumps are kept for the next task, not only the newest two."""
    pa = pytest.importorskip("pyarrow")
    table = pa.table({name: np.arange(MIB // 4, dtype=np.float64) + k for k, name in enumerate("abcd")})
    session = Session(Settings.from_user("1M", "r", None, None))
    try:
        for _ in range(3):
            ok, value = session.finish(run_task(session.pack_task(_length, (table,))))
            assert ok and value == table.num_rows
        assert session.stats.buffers_dumped == 4
    finally:
        session.close()


@pytest.mark.parametrize("method", ["map", "imap"])
def test_pool_map_tasks_with_new_dumps_wait_while_every_worker_and_the_queue_has_one(tmp_path, method):
    """The pool's task thread, too, stops packing at a heavy task per worker and one queued."""
    gate = str(tmp_path / "go")
    _packed.clear()
    tables = [{f"key-{j}": j + i for j in range(100_000)} for i in range(10)]  # about 1.7 MB pickled each
    items = [(gate, PackProbe(i), tables[i]) for i in range(10)]
    with memshare.MemmappingPool(2) as pool:
        if method == "map":
            pending = pool.starmap_async(wait_for_table, items, chunksize=1)
        else:
            pending = pool.imap(_wait_for_table_item, items)
        try:
            assert wait_until(lambda: len(_packed) >= 3, timeout=60)
            time.sleep(1.0)  # give the task thread every chance to go on
            packed_while_blocked = sorted(_packed)
        finally:
            open(gate, "w").close()
        results = pending.get(120) if method == "map" else list(pending)
    assert packed_while_blocked == [0, 1, 2]
    assert results == [(i, i) for i in range(10)]


def _wait_for_table_item(item):
    return wait_for_table(*item)


def test_terminating_a_pool_whose_map_waits_for_room_does_not_wait_for_the_heavy_tasks(tmp_path):
    """terminate() joins the task thread: a map waiting there for room must stop waiting (it gives up only after
    HEAVY_WAIT, 30 s, otherwise)."""
    gate = str(tmp_path / "never")
    _packed.clear()
    tables = [{f"key-{j}": j + i for j in range(100_000)} for i in range(6)]
    pool = memshare.MemmappingPool(2)
    try:
        pool.starmap_async(wait_for_table, [(gate, PackProbe(i), tables[i]) for i in range(6)], chunksize=1)
        assert wait_until(lambda: len(_packed) >= 3, timeout=60)
        time.sleep(0.5)  # the task thread is now waiting for room
        started = time.monotonic()
    finally:
        pool.terminate()
    pool.join()
    assert time.monotonic() - started < 15  # a hang guard, not a speed claim


class Collectable:
    """An argument whose collection a weak reference can see."""


def test_an_abandoned_batch_lets_go_of_its_arguments_before_it_is_packed():
    # A broken executor's feeder thread may keep the task in its queue long after the call ended (loky 3.4's
    # does): the task must not keep the caller's data alive meanwhile.
    import gc
    import weakref

    from memshare._frontends._deferred import DeferredFeed

    session = Session(Settings.from_user("1M", "r", None, None))
    try:
        feed = DeferredFeed(session, workers=2)
        argument = Collectable()
        watch = weakref.ref(argument)
        deferred = feed.defer((len, (argument,), {}))
        del argument
        feed.abandon(deferred)
        gc.collect()
        assert watch() is None, "the abandoned task still holds its arguments"
        rebuild, args = deferred.__reduce__()  # loky's feeder pickling it later: an Unsent placeholder
        ok, error = feed.outcome(rebuild(*args))
        assert ok is False and "ended before it was sent" in str(error)
    finally:
        session.close()


class _Backend:
    """Stands for the joblib backend a feed reports to: it holds the call's iterable, the caller's data."""

    def __init__(self, data):
        self.data = data

    def note(self, nbytes, batch):
        self.noted = nbytes


def test_a_task_left_in_a_queue_keeps_neither_the_backend_nor_the_call_alive():
    # With joblib 1.3 (loky 3.4) a failed call's unsent tasks stay in the executor's queue until its next
    # use; through the feed's callback they kept the backend, its Parallel and the call's generator, and
    # so the caller's frame, whose kept Arrow files then outlived it.
    import gc
    import weakref

    from memshare._frontends._deferred import DeferredFeed

    session = Session(Settings.from_user("1M", "r", None, None))
    try:
        data = Collectable()
        watch = weakref.ref(data)
        backend = _Backend(data)
        feed = DeferredFeed(session, workers=2, on_packed=backend.note)
        queued = feed.defer((len, ((),), {}))  # what the executor's queue holds
        del data, backend
        gc.collect()
        assert watch() is None, "a queued task keeps the backend and the caller's data alive"
        rebuild, args = queued.__reduce__()  # packed later all the same, with nobody to tell
        assert rebuild is not None
    finally:
        session.close()
