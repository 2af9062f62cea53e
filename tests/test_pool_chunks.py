"""``MemmappingPool`` sends a chunk of ``map``/``imap`` items as one task, and chunks keep sharing.

The standard pool sends ``chunksize`` items per message; so does memshare, each chunk packed in one pass of its
pickler. These tests check the values and their order, the standard defaults, the errors, and that arrays in
chunks are still dumped once and sent as references.
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
from conftest import total

import memshare
from memshare import MemmappingPool


def add_one(x):
    return x + 1


def add(x, y):
    return x + y


def fail_on_five(x):
    if x == 5:
        raise KeyError("five")
    return x


@pytest.fixture(scope="module")
def pool():
    with MemmappingPool(2) as pool:
        yield pool


@pytest.mark.parametrize("chunksize", [None, 1, 3, 7, 1000])
def test_map_and_starmap_values_in_order(pool, chunksize):
    assert pool.map(add_one, range(50), chunksize) == list(range(1, 51))
    assert pool.starmap(add, [(i, i) for i in range(50)], chunksize) == [2 * i for i in range(50)]
    assert pool.map_async(add_one, range(23), chunksize).get(timeout=60) == list(range(1, 24))


@pytest.mark.parametrize("chunksize", [1, 4, 9])
def test_imap_values_in_order_and_unordered_all_there(pool, chunksize):
    assert list(pool.imap(add_one, iter(range(41)), chunksize)) == list(range(1, 42))
    assert sorted(pool.imap_unordered(add_one, iter(range(41)), chunksize)) == list(range(1, 42))


def test_map_default_chunks_like_the_standard_pool():
    with MemmappingPool(2) as pool:
        pool.map(add_one, range(100))
    # 100 items, 2 workers: the standard pool's chunks of ceil(100 / 8) = 13 items, so 8 tasks.
    assert memshare.last_call_stats()["tasks"] == 8


def test_empty_map(pool):
    assert pool.map(add_one, []) == []
    assert list(pool.imap(add_one, [], 5)) == []


def test_map_async_callback_gets_the_joined_list(pool):
    seen = []
    result = pool.map_async(add_one, range(10), 3, callback=seen.append)
    assert result.get(timeout=60) == list(range(1, 11))
    result.wait(timeout=60)
    assert result.ready() and result.successful()
    assert seen == [list(range(1, 11))]


def test_an_item_that_raises_fails_the_map_with_its_exception(pool):
    errors = []
    result = pool.map_async(fail_on_five, range(10), 4, error_callback=errors.append)
    with pytest.raises(KeyError, match="five"):
        result.get(timeout=60)
    assert not result.successful()
    assert len(errors) == 1 and isinstance(errors[0], KeyError)
    with pytest.raises(KeyError, match="five"):
        list(pool.imap(fail_on_five, range(10), 3))
    assert pool.map(add_one, range(5), 2) == [1, 2, 3, 4, 5]  # the pool is still usable


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3", True])
def test_bad_chunksize_is_refused_with_the_fix(pool, bad):
    with pytest.raises(ValueError, match="positive number of items per task"):
        pool.map(add_one, range(5), bad)
    with pytest.raises(ValueError, match="positive number of items per task"):
        pool.imap(add_one, range(5), bad)


def size_and_ends(a: np.ndarray) -> tuple:
    # Reads both ends, not every element: a sum over 100 MB in each of 1000 tasks is 100 GB of reading.
    return a.size, float(a[0]), float(a[-1])


def test_an_array_repeated_in_every_item_is_dumped_once_and_sent_as_references(shm_dir):
    big = np.ones(100 * 1024**2 // 8)  # 100 MB
    big[-1] = 2.0
    with MemmappingPool(2, promote=False) as pool:
        assert pool.map(size_and_ends, [big] * 1000) == [(big.size, 1.0, 2.0)] * 1000
    stats = memshare.last_call_stats()
    assert stats["arrays_dumped"] == 1 and stats["bytes_dumped"] == big.nbytes
    assert stats["tasks"] == 8  # 1000 items in the standard 8 chunks
    # Each chunk carries 125 references, a few hundred bytes each, never the 100 MB.
    assert stats["bytes_pickled"] < 8 * 125 * 1024


def test_distinct_arrays_in_one_chunk_are_each_dumped_once(shm_dir):
    arrays = [np.full(200_000, float(i)) for i in range(6)]
    with MemmappingPool(2, promote=False) as pool:
        items = arrays + arrays  # each array twice, in the same chunk and in another
        assert pool.map(total, items, chunksize=4) == [200_000.0 * i for i in range(6)] * 2
    assert memshare.last_call_stats()["arrays_dumped"] == 6


def test_large_results_of_a_chunk_come_back_through_shared_memory():
    with MemmappingPool(2) as pool:
        values = pool.map(np.ones, [300_000] * 6, chunksize=3)
    assert all(type(value) is np.ndarray and value.sum() == 300_000 for value in values)
    assert memshare.last_call_stats()["results_by_reference"] == 6


def test_standard_pool_agrees_on_chunked_values():
    with multiprocessing.get_context("fork").Pool(2) as standard, MemmappingPool(2, context="fork") as ours:
        for chunksize in (None, 1, 5):
            assert ours.map(add_one, range(37), chunksize) == standard.map(add_one, range(37), chunksize)


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("not today")


def test_an_unpicklable_item_names_the_mapped_function(pool):
    with pytest.raises(memshare.UnpicklableArgumentError, match="call of add_one to a worker"):
        pool.map(add_one, [1, 2, _Unpicklable(), 4], chunksize=2)
