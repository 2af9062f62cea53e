"""Large argument objects (a dict, a list, an object-dtype column, a model) pickled once per call, not once per task."""

from __future__ import annotations

import os
import pickle

import joblib
import numpy as np
import pytest
from conftest import memfds_held, memshare_entries

import memshare
from memshare import MemmappingPool, Parallel, delayed
from memshare._payload._routes import OBJECT_DUMP, OBJECT_DUMP_MIN, PICKLE, object_candidate, object_route

pd = pytest.importorskip("pandas")

MIB = 1024**2


def big_table(entries=200_000):
    """A dict that pickles to about 3.5 MB: far above the default max_nbytes (1 MiB)."""
    return {f"key-{i}": i for i in range(entries)}


def lookup(table, k):
    return table[f"key-{k}"] + len(table)


def keys_and_identity(first, second):
    return len(first), first is second[0]


def mutate_and_measure(table):
    table["added by a task"] = os.getpid()
    return len(table)


def echo(value, k=0):
    return value


def fail_on(table, k):
    if k == 3:
        raise ValueError("task 3 fails")
    return len(table)


def stats():
    return memshare.last_call_stats()


def test_a_dict_passed_to_every_task_is_pickled_once_per_call():
    table = big_table()
    expected = [lookup(table, k) for k in range(30)]
    assert Parallel(n_jobs=2)(delayed(lookup)(table, k) for k in range(30)) == expected
    figures = stats()
    assert figures["objects_dumped"] == 1, figures
    assert figures["bytes_objects_dumped"] > MIB
    assert figures["bytes_pickled"] < MIB, figures  # every task's payload names the dump: no copy of the dict


@pytest.mark.parametrize("way", ["map", "starmap", "apply_async", "kwargs"])
def test_pool_calls_pickle_a_large_argument_once(way):
    table = big_table()
    expected = [lookup(table, k) for k in range(12)]
    with MemmappingPool(2) as pool:
        if way == "map":
            got = pool.map(len, [table] * 12, chunksize=2)
            expected = [len(table)] * 12
        elif way == "starmap":
            got = pool.starmap(lookup, [(table, k) for k in range(12)], chunksize=3)
        elif way == "apply_async":
            got = [r.get(timeout=120) for r in [pool.apply_async(lookup, (table, k)) for k in range(12)]]
        else:
            got = [pool.apply(lookup, kwds={"table": table, "k": k}) for k in range(12)]
        pool.close()
        pool.join()
    assert got == expected
    figures = stats()  # the pool's, once it is closed
    if way in ("map", "starmap"):
        assert figures["objects_dumped"] == 1, figures
    else:
        # One call per apply: pickled once per apply, never by value into the pipe.
        assert figures["objects_dumped"] >= 1 and figures["bytes_pickled"] < 12 * MIB, figures


def test_each_task_gets_its_own_object_as_under_joblib():
    table = big_table()
    ours = Parallel(n_jobs=2)(delayed(mutate_and_measure)(table) for _ in range(6))
    theirs = joblib.Parallel(n_jobs=2, backend="loky")(joblib.delayed(mutate_and_measure)(table) for _ in range(6))
    assert ours == theirs == [len(table) + 1] * 6
    assert "added by a task" not in table


def test_an_object_reached_twice_in_a_task_is_one_object_there():
    table = big_table()
    ours = Parallel(n_jobs=2)(delayed(keys_and_identity)(table, [table]) for _ in range(4))
    theirs = joblib.Parallel(n_jobs=2)(joblib.delayed(keys_and_identity)(table, [table]) for _ in range(4))
    assert ours == theirs == [(len(table), True)] * 4


def test_a_small_object_stays_in_the_task_payload():
    small = {"alpha": 1, "beta": [1, 2, 3]}
    assert Parallel(n_jobs=2)(delayed(echo)(small) for _ in range(4)) == [small] * 4
    assert stats()["objects_dumped"] == 0


def test_a_change_between_calls_reaches_the_next_call():
    table = big_table()
    with Parallel(n_jobs=2) as parallel:
        first = parallel(delayed(len)(table) for _ in range(4))
        table["one more"] = 1
        second = parallel(delayed(len)(table) for _ in range(4))
    assert first == [len(table) - 1] * 4 and second == [len(table)] * 4


@pytest.mark.parametrize(
    "make",
    [
        lambda: [f"item {i}" for i in range(150_000)],
        lambda: {"rows": big_table(), "weights": np.arange(300_000, dtype=np.float64)},
        lambda: pd.DataFrame({"name": pd.Series([f"n{i}" for i in range(150_000)], dtype=object), "x": 1.5}),
        lambda: pd.Series([f"s{i}" for i in range(150_000)], dtype=object),
        lambda: bytearray(3 * MIB),
    ],
    ids=["list", "dict-with-array", "object-dataframe", "object-series", "bytearray"],
)
def test_values_and_types_are_joblibs(make):
    value = make()
    ours = Parallel(n_jobs=2)(delayed(echo)(value, k) for k in range(3))
    theirs = joblib.Parallel(n_jobs=2, backend="loky")(joblib.delayed(echo)(value, k) for k in range(3))
    for mine, other in zip(ours, theirs):
        assert type(mine) is type(other) is type(value)
        if isinstance(value, pd.DataFrame):
            pd.testing.assert_frame_equal(mine, other)
            pd.testing.assert_frame_equal(mine, value)
        elif isinstance(value, pd.Series):
            pd.testing.assert_series_equal(mine, value)
        elif isinstance(value, dict):
            assert mine["rows"] == value["rows"]
            np.testing.assert_array_equal(mine["weights"], value["weights"])
        else:
            assert mine == other == value
    assert stats()["objects_dumped"] == 1


def test_arrow_columns_inside_an_object_still_travel_out_of_band():
    pa = pytest.importorskip("pyarrow")
    column = pd.Series([f"value {i:08d}" for i in range(200_000)], dtype=pd.ArrowDtype(pa.string()))
    bundle = {"column": column, "lookup": big_table(100_000)}
    ours = Parallel(n_jobs=2)(delayed(echo)(bundle, k) for k in range(3))
    for mine in ours:
        # equals() with the dtype, not assert_series_equal: pandas 1.5 compares Arrow strings one by one (1.5 s).
        assert mine["column"].dtype == column.dtype and mine["column"].equals(column)
        assert mine["lookup"] == bundle["lookup"]
    figures = stats()
    assert figures["objects_dumped"] == 1 and figures["buffers_dumped"] >= 1, figures


def test_object_candidates_are_cheap_to_tell():
    assert not object_candidate(3, 1024)
    assert not object_candidate("text" * 1000, 1024)
    assert not object_candidate(np.zeros(10**6), 1024)  # arrays are routed one by one
    assert not object_candidate({"a": 1, "b": (2, 3)}, 1024)
    assert not object_candidate(big_table(), None)  # max_nbytes=None: nothing leaves the stream
    assert object_candidate(big_table(10_000), 1024)  # about 170 kB
    assert not object_candidate(big_table(100), 1024)  # 1.5 kB: below OBJECT_DUMP_MIN, measured exactly
    assert object_candidate([f"{i}" * 8000 for i in range(10)], 1024)
    assert not object_candidate(["x" * 400] * 3, 1024)  # surely below OBJECT_DUMP_MIN
    # Plain containers are measured exactly: one 80 kB string ten times pickles once.
    assert not object_candidate(["x" * 80_000] * 10, 10**6)
    assert object_candidate(["x" * 80_000] * 10, 1024)
    big = list(range(10**6))
    assert object_candidate(big, 1024) and not object_candidate(big, 10**7)


def test_plain_values_are_measured_at_most_a_frame_past_the_limit(monkeypatch):
    from memshare._payload import _plain

    written = []
    real = _plain._Bounded.write

    def write(self, data):
        written.append(len(data))
        return real(self, data)

    monkeypatch.setattr(_plain._Bounded, "write", write)
    assert _plain.plain_size_below(list(range(10**6)), 100_000) is False
    assert 100_000 <= sum(written) < 100_000 + 2**17  # stopped, not the whole list's 5 MB
    assert _plain.plain_size_below({"a": [1.5, "b", None]}, 100) is True
    assert _plain.plain_size_below([np.zeros(3)], 10**6) is None  # not plain: the walk decides


def test_small_objects_stay_in_the_task_whatever_max_nbytes():
    """A max_nbytes meant for arrays (joblib's tests use 2 bytes) sends no small object to a file."""
    assert object_route(OBJECT_DUMP_MIN - 1, 2).kind == PICKLE
    assert object_route(OBJECT_DUMP_MIN, 2).kind == OBJECT_DUMP
    assert object_route(OBJECT_DUMP_MIN, 2 * OBJECT_DUMP_MIN).kind == PICKLE
    assert object_candidate(pd.DataFrame({"x": [1, 2]}), 1024)  # a class instance: pickled to know


def test_nothing_is_left_after_calls_errors_and_a_killed_worker(shm_dir):
    before = len(memfds_held())  # shm_dir: named files in a folder of the test, so that leftovers show
    table = big_table()
    assert Parallel(n_jobs=2)(delayed(len)(table) for _ in range(4)) == [len(table)] * 4
    with pytest.raises(ValueError, match="task 3 fails"):
        Parallel(n_jobs=2)(delayed(fail_on)(table, k) for k in range(8))
    with pytest.raises(memshare.WorkerDiedError):
        Parallel(n_jobs=2)(delayed(os._exit)(1) for _ in range(2))
    with MemmappingPool(2) as pool:
        assert pool.starmap(lookup, [(table, k) for k in range(6)]) == [lookup(table, k) for k in range(6)]
        pool.close()
        pool.join()
    assert memshare_entries(shm_dir) == []
    assert len(memfds_held()) == before


def test_an_unpicklable_argument_object_names_the_function():
    import threading

    with pytest.raises(memshare.UnpicklableArgumentError, match="echo"):
        Parallel(n_jobs=2)(delayed(echo)({"lock": threading.Lock(), "rows": list(range(10))}) for _ in range(2))


def nested_identity(outer, inner):
    return outer["inner"] is inner, len(inner)


def nested_identity_inner_first(inner, outer):
    return nested_identity(outer, inner)


@pytest.mark.parametrize("inner_first", [False, True])
def test_a_large_object_inside_another_is_named_not_copied(inner_first):
    inner = big_table()
    outer = {"inner": inner, "more": [f"row {i}" for i in range(100_000)]}
    if inner_first:
        ours = Parallel(n_jobs=2)(delayed(nested_identity_inner_first)(inner, outer) for _ in range(4))
    else:
        ours = Parallel(n_jobs=2)(delayed(nested_identity)(outer, inner) for _ in range(4))
    assert ours == [(True, len(inner))] * 4  # one object in the task, as under joblib
    figures = stats()
    assert figures["objects_dumped"] == 2, figures
    # The outer payload names the inner dump instead of holding a copy of it.
    assert figures["bytes_objects_dumped"] < 1.1 * len(pickle.dumps(outer, protocol=5)), figures


class Counted:
    """A large object that counts how often the parent pickles it."""

    pickled = 0

    def __init__(self, rows):
        self.rows = rows

    def __reduce__(self):
        Counted.pickled += 1
        return (Counted, (self.rows,))


def rows_of(wrapped, k=0):
    return len(wrapped.rows) + k


def test_objects_are_pickled_once_each_whether_shared_or_not():
    rows = [f"row {i}" for i in range(150_000)]
    Counted.pickled = 0
    shared = Counted(rows)
    assert Parallel(n_jobs=2)(delayed(rows_of)(shared, k) for k in range(10)) == [len(rows) + k for k in range(10)]
    assert Counted.pickled == 1  # measured once; that payload was the one written
    Counted.pickled = 0
    assert Parallel(n_jobs=2)(delayed(rows_of)(Counted(rows)) for _ in range(6)) == [len(rows)] * 6
    assert Counted.pickled == 6  # one new object per task: pickled once each, as joblib does
    assert stats()["objects_dumped"] == 6


def table_and_key(pair):
    table, k = pair
    return table[f"key-{k}"]


def test_a_large_object_in_a_small_tuple_per_task_is_pickled_once_per_call():
    table = big_table()
    assert Parallel(n_jobs=2)(delayed(table_and_key)((table, k)) for k in range(12)) == list(range(12))
    figures = stats()
    assert figures["objects_dumped"] == 1 and figures["bytes_pickled"] < MIB, figures


def rows_and_identity(first, second):
    return len(first.rows), first is second[0]


def test_a_small_object_made_for_each_task_is_pickled_once_per_task():
    rows = [f"row {i}" for i in range(200)]  # far below max_nbytes, but more than the quick look counts
    Counted.pickled = 0
    assert Parallel(n_jobs=2)(delayed(rows_of)(Counted(rows), k) for k in range(8)) == [200 + k for k in range(8)]
    assert Counted.pickled == 8  # measured once each, and that payload was sent: no second pickling
    assert stats()["objects_dumped"] == 0
    shared = Counted(rows)
    Counted.pickled = 0
    # batch_size=1: joblib's automatic batching may put two fast tasks in one batch, whose one stream pickles the
    # object once for both (pickle's memo), as joblib does; the count is per task only with one task per batch.
    calls = Parallel(n_jobs=2, batch_size=1)(delayed(rows_and_identity)(shared, [shared]) for _ in range(6))
    assert calls == [(200, True)] * 6
    assert Counted.pickled == 6  # once per task, as joblib: the same small object is not measured again
