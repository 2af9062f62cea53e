"""memshare.broadcast: an object pickled once in the parent and unpickled once per worker."""

from __future__ import annotations

import gc
import os
import pickle

import numpy as np
import pytest

import memshare
from memshare._payload import _broadcast
from memshare._transport._backing import find_backing

pd = pytest.importorskip("pandas")


def _identity_of_value(shared):
    """What a task sees: the object's id in this worker, the worker's pid, and the value's size."""
    return os.getpid(), id(shared.value), len(shared.value)


def _held_tokens(_):
    import memshare._payload._broadcast as module

    return os.getpid(), module.received_tokens()


def _mutate(shared):
    shared.value["added"] = os.getpid()
    return len(shared.value)


def _array_write(shared):
    try:
        shared.value["array"][0] = 1.0
    except ValueError as exc:
        return str(exc)
    return "written"


def _sum_array(shared):
    return float(shared.value["array"].sum()), shared.value["array"].flags.writeable


@pytest.fixture
def table():
    return {f"key-{i}": i for i in range(20000)}


def test_value_in_the_parent_is_the_object_itself(table):
    shared = memshare.broadcast(table)
    assert shared.value is table
    assert shared.nbytes >= len(pickle.dumps(table, protocol=5))
    assert "Broadcast of dict" in repr(shared)


def test_each_worker_unpickles_once_across_tasks_and_calls(table):
    shared = memshare.broadcast(table)
    with memshare.Parallel(n_jobs=2) as parallel:
        first = parallel(memshare.delayed(_identity_of_value)(shared) for _ in range(20))
        second = parallel(memshare.delayed(_identity_of_value)(shared) for _ in range(20))
    ids_by_pid = {}
    for pid, value_id, length in first + second:
        assert length == len(table)
        ids_by_pid.setdefault(pid, set()).add(value_id)
    assert os.getpid() not in ids_by_pid
    # One object per worker, however many tasks and calls it served.
    assert all(len(ids) == 1 for ids in ids_by_pid.values()), ids_by_pid


def test_pool_tasks_share_one_copy_per_worker(table):
    shared = memshare.broadcast(table)
    with memshare.MemmappingPool(2) as pool:
        seen = pool.map(_identity_of_value, [shared] * 30, chunksize=1)
        pool.close()
        pool.join()
    ids_by_pid = {}
    for pid, value_id, _ in seen:
        ids_by_pid.setdefault(pid, set()).add(value_id)
    assert all(len(ids) == 1 for ids in ids_by_pid.values()), ids_by_pid


def test_dropped_in_the_parent_is_freed_in_workers(table):
    shared = memshare.broadcast(table)
    token = shared._token
    with memshare.MemmappingPool(2) as pool:
        pool.map(_identity_of_value, [shared] * 8, chunksize=1)
        held = dict(pool.map(_held_tokens, range(8), chunksize=1))
        assert any(token in tokens for tokens in held.values()), held
        del shared
        gc.collect()
        # Every worker's next task finds the file gone and lets its copy go.
        after = dict(pool.map(_held_tokens, range(20), chunksize=1))
        pool.close()
        pool.join()
    assert after and all(token not in tokens for tokens in after.values()), after


def test_a_mutating_task_changes_only_its_workers_copy(table):
    shared = memshare.broadcast(table)
    with memshare.Parallel(n_jobs=2) as parallel:
        parallel(memshare.delayed(_mutate)(shared) for _ in range(4))
    assert "added" not in table


def test_arrays_inside_are_read_only_shared_memory():
    array = np.arange(1_000_000, dtype=np.float64)
    shared = memshare.broadcast({"array": array})
    with memshare.Parallel(n_jobs=2) as parallel:
        sums = parallel(memshare.delayed(_sum_array)(shared) for _ in range(4))
        errors = parallel(memshare.delayed(_array_write)(shared) for _ in range(2))
    assert sums == [(float(array.sum()), False)] * 4
    assert all("read-only" in error for error in errors), errors
    assert shared.nbytes >= array.nbytes


def test_dataframe_with_object_and_arrow_columns_round_trips():
    pa = pytest.importorskip("pyarrow")
    frame = pd.DataFrame(
        {
            "objects": pd.Series([f"s{i}" for i in range(5000)], dtype=object),
            "numbers": np.arange(5000, dtype=np.int64),
            "arrow": pd.Series([f"a{i}" for i in range(5000)], dtype=pd.ArrowDtype(pa.string())),
        }
    )
    shared = memshare.broadcast(frame)
    with memshare.Parallel(n_jobs=2) as parallel:
        back = parallel(memshare.delayed(lambda b: b.value)(shared) for _ in range(2))
    for result in back:
        pd.testing.assert_frame_equal(result, frame)


def test_other_picklers_carry_the_object_by_value(table):
    shared = memshare.broadcast(table)
    copy = pickle.loads(pickle.dumps(shared))
    assert copy.value == table


def test_a_broadcast_that_comes_back_is_the_parents_own(table):
    shared = memshare.broadcast(table)
    with memshare.Parallel(n_jobs=2) as parallel:
        (back,) = parallel(memshare.delayed(lambda b: b)(shared) for _ in range(1))
    assert back is shared


def test_nothing_is_left_once_dropped(table):
    shared = memshare.broadcast(table)
    backing = find_backing(shared._data)
    assert backing is not None
    path = backing.path
    assert os.path.exists(path)
    del shared
    gc.collect()
    assert not os.path.exists(path)


def test_threading_and_sequential_backends_see_the_parents_object(table):
    import joblib

    shared = memshare.broadcast(table)
    for backend in ("threading", "sequential"):
        with joblib.parallel_config(backend=backend):
            ids = joblib.Parallel(n_jobs=2)(joblib.delayed(lambda b: id(b.value))(shared) for _ in range(3))
        assert set(ids) == {id(table)}


def test_joblib_loky_backend_gets_the_object(table):
    import joblib

    shared = memshare.broadcast(table)
    lengths = joblib.Parallel(n_jobs=2, backend="loky")(
        joblib.delayed(lambda b: len(b.value))(shared) for _ in range(3)
    )
    assert lengths == [len(table)] * 3


def test_received_table_is_empty_in_the_parent(table):
    memshare.broadcast(table)
    assert _broadcast.received_tokens() == []


def _version_and_length(shared):
    return shared.value["version"], len(shared.value["items"])


@pytest.mark.parametrize("context", ["fork", "forkserver", "spawn"])
def test_workers_see_the_object_as_it_was_at_broadcast_under_every_start_method(context):
    """A change made after ``broadcast()`` stays in the parent: a forked worker gets the snapshot too."""
    value = {"version": 1, "items": list(range(100_000))}
    shared = memshare.broadcast(value)
    value["version"] = 2
    value["items"].append(100_000)
    with memshare.MemmappingPool(2, context=context) as pool:
        seen = set(pool.map(_version_and_length, [shared] * 8, chunksize=1))
        pool.close()
        pool.join()
    assert seen == {(1, 100_000)}
    assert shared.value is value  # the parent's own object, changes and all
    with memshare.Parallel(n_jobs=2) as parallel:
        assert set(parallel(memshare.delayed(_version_and_length)(shared) for _ in range(4))) == {(1, 100_000)}
