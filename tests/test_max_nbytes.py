"""One rule for ``max_nbytes``, joblib's: data of more than ``max_nbytes`` bytes is shared, exactly that is pickled.

joblib's memmapping reducer (``joblib/_memmapping_reducer.py``,
``ArrayMemmapForwardReducer.__call__``) memmaps an array when
``a.nbytes > self._max_nbytes``: an array of exactly ``max_nbytes`` bytes is
pickled, one byte more is memmapped. :func:`test_joblib_itself_pickles_exactly_max_nbytes`
checks that rule against the installed joblib, and the tests below hold
memshare to it for arrays, Arrow buffers (behind a pandas column) and
argument objects, under ``Parallel`` and ``MemmappingPool``.
"""

from __future__ import annotations

import joblib
import numpy as np
import pytest
from conftest import mappings_of, memfds_held, memshare_entries

import memshare
from memshare import MemmappingPool, Parallel, delayed
from memshare._payload._reducers import pack
from memshare._payload._routes import OBJECT_DUMP, OBJECT_DUMP_MIN, OUT_OF_BAND, PICKLE, buffer_route, object_route

pa = pytest.importorskip("pyarrow")
pd = pytest.importorskip("pandas")

#: max_nbytes for arrays and buffers: below OBJECT_DUMP_MIN, so that a pandas column pickled whole stays
#: in its task's payload rather than becoming an argument object of its own.
LIMIT = 32 * 1024
#: max_nbytes for argument objects, which never go to a dump below OBJECT_DUMP_MIN.
OBJECT_LIMIT = 2 * OBJECT_DUMP_MIN
TRANSPORTS = ["Parallel", "MemmappingPool"]
#: nbytes relative to max_nbytes -> whether the data leaves the task payload.
SIZES = {0: False, 1: True}


def run(transport: str, func, arguments: list, max_nbytes: int) -> list:
    """``func(argument)`` for each argument, in 2 workers, with memshare's ``transport``."""
    if transport == "Parallel":
        return Parallel(n_jobs=2, max_nbytes=max_nbytes, batch_size=1)(delayed(func)(a) for a in arguments)
    with MemmappingPool(2, max_nbytes=max_nbytes) as pool:
        return pool.map(func, arguments, chunksize=1)


def in_shared_file(address: int) -> bool:
    """In the task: True when ``address`` lies in a mapping of memshare's or joblib's shared files."""
    ((path, _),) = mappings_of([address])
    return "memshare" in path or "joblib" in path


def array_shared(x: np.ndarray) -> bool:
    return in_shared_file(x.__array_interface__["data"][0])


def column_shared(series) -> bool:
    (chunk,) = series.array.__arrow_array__().chunks  # the column's own chunk, as it was sent
    return in_shared_file(chunk.buffers()[1].address)


def leaks(shm_dir) -> list:
    return memshare_entries(shm_dir) + memfds_held()


@pytest.mark.parametrize("extra, shared", SIZES.items())
def test_joblib_itself_pickles_exactly_max_nbytes(extra, shared):
    x = np.ones(LIMIT + extra, dtype=np.uint8)
    seen = joblib.Parallel(n_jobs=2, backend="loky", max_nbytes=LIMIT)(delayed(array_shared)(x) for _ in range(2))
    assert seen == [shared, shared]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("extra, shared", SIZES.items())
def test_an_array_of_exactly_max_nbytes_is_pickled(shm_dir, transport, extra, shared):
    x = np.ones(LIMIT + extra, dtype=np.uint8)
    assert run(transport, array_shared, [x, x], LIMIT) == [shared, shared]
    stats = memshare.last_call_stats()
    assert stats["arrays_dumped"] + stats["arrays_held_once"] == int(shared), stats
    assert stats["buffers_dumped"] == 0, stats
    assert (stats["arrays_pickled"] == 1) is not shared, stats
    del x
    assert leaks(shm_dir) == []


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("extra, shared", SIZES.items())
def test_an_arrow_buffer_of_exactly_max_nbytes_is_pickled(shm_dir, transport, extra, shared):
    values = pa.array(np.ones(LIMIT + extra, dtype=np.uint8))  # one data buffer of LIMIT + extra bytes, no nulls
    assert values.buffers()[0] is None and values.buffers()[1].size == LIMIT + extra
    column = pd.Series(values, dtype=pd.ArrowDtype(pa.uint8()))
    assert run(transport, column_shared, [column, column], LIMIT) == [shared, shared]
    stats = memshare.last_call_stats()
    assert stats["buffers_dumped"] == int(shared), stats
    assert stats["objects_dumped"] == 0, stats
    del column, values
    assert leaks(shm_dir) == []


def blob_of(nbytes: int) -> dict:
    """A dict that memshare's pickler writes in exactly ``nbytes`` bytes."""
    overhead = len(pack({"blob": bytes(nbytes)}, lambda array: None)) - nbytes
    blob = {"blob": bytes(nbytes - overhead)}
    assert len(pack(blob, lambda array: None)) == nbytes
    return blob


def blob_size(blob: dict) -> int:
    return len(blob["blob"])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("extra, shared", SIZES.items())
def test_an_object_of_exactly_max_nbytes_is_pickled(shm_dir, transport, extra, shared):
    blob = blob_of(OBJECT_LIMIT + extra)
    assert run(transport, blob_size, [blob, blob], OBJECT_LIMIT) == [len(blob["blob"])] * 2
    stats = memshare.last_call_stats()
    assert stats["objects_dumped"] == int(shared), stats
    assert (stats["bytes_pickled"] > 2 * OBJECT_LIMIT) is not shared, stats  # by value: in both tasks' payloads
    assert leaks(shm_dir) == []


def test_the_routes_follow_the_rule_at_the_boundary():
    assert buffer_route(LIMIT, True, LIMIT).kind == PICKLE
    assert buffer_route(LIMIT + 1, True, LIMIT).kind == OUT_OF_BAND
    assert object_route(OBJECT_LIMIT, OBJECT_LIMIT).kind == PICKLE
    assert object_route(OBJECT_LIMIT + 1, OBJECT_LIMIT).kind == OBJECT_DUMP
    assert object_route(OBJECT_DUMP_MIN, 0).kind == OBJECT_DUMP  # the floor still holds from OBJECT_DUMP_MIN on
