"""A worker holding many broadcasts pays for each task what it pays holding one.

Each worker keeps a copy of every broadcast it received while the parent
keeps it. It used to check every copy's shared file (and every cached
mapping of one) before each task: with thousands of live broadcasts, tiny
tasks took 50-100 times joblib's time. The checks are counted here, not timed
(``benchmarks/many_broadcasts.py`` times them).
"""

from __future__ import annotations

import gc
import os

import memshare
from memshare._payload import _broadcast, _drop_log

HELD = 300


def _count_checks(_):
    """Count, from now on in this worker, every check that a held broadcast's or a cached mapping's file exists."""
    from memshare._payload import _broadcast as broadcasts
    from memshare._transport import _mapping, _refs

    counts = {"checks": 0}

    def counted(path, identity):
        counts["checks"] += 1
        return _refs.is_file(path, identity)

    broadcasts.is_file = counted
    _mapping.is_file = counted
    globals()["_counts"] = counts
    return os.getpid()


def _checks_so_far(_):
    return os.getpid(), globals()["_counts"]["checks"]


def _held(_):
    from memshare._transport import _mapping

    return os.getpid(), len(_broadcast.received_tokens()), len(_mapping.cache)


def _size(shared):
    return len(shared.value)


def test_tasks_check_nothing_per_broadcast_held():
    held = [memshare.broadcast({"k": i, "v": list(range(i % 7))}) for i in range(HELD)]
    with memshare.MemmappingPool(1) as pool:
        assert pool.map(_size, held, chunksize=1) == [2] * HELD
        ((pid, copies, mapped),) = set(pool.map(_held, range(1)))
        assert copies == HELD
        # A copy holds its own mapping: the worker's mapping cache does not keep one per broadcast.
        assert mapped < 10, mapped
        pool.apply(_count_checks, (0,))
        for _ in range(20):
            pool.apply(_size, (held[0],))
        assert pool.apply(_checks_so_far, (0,)) == (pid, 0)
        pool.close()
        pool.join()


def test_copies_of_dropped_broadcasts_go_however_many_were_dropped():
    """More drops between two tasks than the parent's record of drops holds: the worker still lets them go."""
    kept = memshare.broadcast("kept")
    many = [memshare.broadcast(i) for i in range(3 * _drop_log.DROP_SLOTS)]
    few = [memshare.broadcast(-i) for i in range(3)]
    with memshare.MemmappingPool(1) as pool:
        pool.map(_size_or_value, [kept, *many, *few], chunksize=16)
        assert pool.apply(_held, (0,))[1] == 1 + len(many) + len(few)
        del many
        gc.collect()
        assert pool.apply(_held, (0,))[1] == 1 + len(few)
        del few
        gc.collect()
        assert pool.apply(_held, (0,))[1] == 1
        assert pool.apply(_size_or_value, (kept,)) == 4
        pool.close()
        pool.join()


def _size_or_value(shared):
    return len(shared.value) if isinstance(shared.value, str) else shared.value


def test_a_drop_recorded_inside_another_is_not_lost():
    """Drops are recorded by finalizers, which a garbage collection may run inside another drop's recording."""
    log = _drop_log.DropLog()
    first, second = "aa" * 16, "bb" * 16
    log._lock.acquire()  # as if this thread were recording a drop when the collection ran
    try:
        log.add(first)  # must neither wait for itself nor be lost
        assert _drop_log.read_drops(log.array, 0) == (0, [])
    finally:
        log._lock.release()
    log.add(second)
    assert _drop_log.read_drops(log.array, 0) == (2, [first, second])
