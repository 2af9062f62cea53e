"""Small pool tasks take the short ways: the standard pickler where it makes memshare's stream, tuples on the wire.

Each short way must give what the full one gives: these tests compare values, and check that anything an
array, a buffer or a reducer could be in still takes the full way.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from memshare import MemmappingPool
from memshare._payload._main_values import MainFunction
from memshare._payload._plain import plain_call, plain_stream

PLAIN_VALUES = [1, "a", None, 1.5, True, b"x", [1, 2, "x"], (1, (2, 3)), {"a": (1, 2)}, {1, 2}, frozenset({3}), [[[]]]]


@pytest.mark.parametrize("value", PLAIN_VALUES)
def test_a_plain_value_is_pickled_by_the_standard_pickler(value):
    stream = plain_stream(value)
    assert stream is not None and pickle.loads(stream) == value


@pytest.mark.parametrize(
    "value",
    [np.ones(3), [np.ones(3)], {"a": np.float64(1.0)}, 2j, [2j], [pickle.PickleBuffer(b"abc")], [object()]],
    ids=["array", "array-in-list", "numpy-scalar", "complex", "complex-in-list", "buffer", "object"],
)
def test_anything_an_array_buffer_or_reducer_could_be_in_is_not_plain(value):
    assert plain_stream(value) is None


def _top_level(x):
    return x


def test_a_plain_call_is_a_function_sent_by_name_with_plain_arguments():
    by_name = MainFunction(_top_level)
    assert plain_call(by_name, (1, "a", None), {"k": 2.5})
    assert plain_call(_top_level, (1,), {})  # of an importable module: by reference for cloudpickle too
    assert not plain_call(by_name, (np.ones(2),), {})
    assert not plain_call(by_name, ([1],), {})  # a list may hold anything
    assert not plain_call(by_name, (1,), {"k": np.ones(2)})


def echo(value):
    return value


def make_array(n):
    return np.full(n, 2.0)


def test_values_of_every_shape_come_back_alike(shm_dir):
    values = PLAIN_VALUES + [2j, [2j], bytearray(b"ab"), np.arange(3), [np.arange(2), 1]]
    with MemmappingPool(2) as pool:
        for value in values:
            back = pool.apply(echo, (value,))
            assert type(back) is type(value)
            assert pickle.dumps(back) == pickle.dumps(value)
        assert pool.map(echo, values, chunksize=3)[: len(PLAIN_VALUES)] == PLAIN_VALUES
        # A large result still comes back through shared memory, as a writable array.
        big = pool.apply(make_array, (300_000,))
        assert type(big) is np.ndarray and big.flags.writeable and big.sum() == 600_000.0


def test_tasks_and_outcomes_travel_as_tuples(shm_dir):
    with MemmappingPool(1) as pool:
        task = pool._feed.pack_call(echo, (1,), {})
        assert type(task) is tuple and [type(part) for part in task] == [int, bytes]
        pool._session.task_done(task[0])
        assert pool.apply(echo, (5,)) == 5


def test_functions_of_importable_modules_make_plain_calls_only_while_their_name_reaches_them(monkeypatch):
    import json
    import operator

    import cloudpickle

    from memshare._payload._plain import plain_call

    assert plain_call(operator.add, (1, 2), {})  # a builtin function of a module
    assert plain_call(json.dumps, ("x",), {"indent": 2})
    assert not plain_call(json.dumps, ([1],), {})  # not a plain argument
    assert not plain_call([].append, (1,), {})  # a bound builtin method: pickling it pickles its list
    assert not plain_call(lambda x: x, (1,), {})
    rebound = json.dumps
    monkeypatch.setattr(json, "dumps", lambda *a, **k: "")
    assert not plain_call(rebound, ("x",), {})  # json.dumps names another function now
    monkeypatch.undo()
    cloudpickle.register_pickle_by_value(json)
    try:
        assert not plain_call(json.dumps, ("x",), {})  # the user asked cloudpickle to send json by value
    finally:
        cloudpickle.unregister_pickle_by_value(json)
    assert plain_call(json.dumps, ("x",), {})
