"""A result that is memory the parent already has in a file comes back as that file: no copy, no new file."""

import dataclasses
import gc
import logging
import os
import signal
import sys

import numpy as np
import pytest
from conftest import array_fit_to_hold

import memshare
from memshare import MemmappingPool, Parallel, delayed
from memshare._config import Settings
from memshare._lifetime import _memfd
from memshare._parent import _held_once
from memshare._parent._session import Session
from memshare._transport._protocol import Outcome
from memshare._transport._refs import DUMP, HELD, ArrayRef
from memshare._worker._run import run_task

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")

MIB = 1024**2
TASKS = 8


def whole(x):
    return x


def first_half(x):
    return x[: x.shape[0] // 2]


def strided_tail(x):
    return x[x.shape[0] // 4 :: 3, ::-1]  # a tail, every third row, columns reversed


VIEWS = {"whole": whole, "first_half": first_half, "strided_tail": strided_tail}


def _shape_of(x):
    return x.reshape(-1, 8)


def whole_or_fail(x, i):
    if i == 3:
        raise ValueError("task 3 fails")
    return x


def whole_or_die(x, i):
    if i == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


@pytest.fixture
def mechanism(mechanism, default_location):
    """conftest's ``mechanism``, where memshare chooses the location itself."""
    return mechanism


def own_files():
    """This process's memshare files: the memfds it holds and the files in its folders in /dev/shm."""
    found = set(_memfd.held_paths())
    for entry in os.listdir("/dev/shm"):
        folder = os.path.join("/dev/shm", entry)
        if entry.startswith(f"memshare-{os.getpid()}-") and os.path.isdir(folder):
            try:
                found.update(os.path.join(folder, name) for name in os.listdir(folder))
            except FileNotFoundError:
                pass
    return found


def mapping_at(address):
    """(inode, name, private anonymous kB) of this process's mapping that holds ``address``, from smaps."""
    found, inside = None, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                if found is not None:
                    return found
                low, high = (int(part, 16) for part in fields[0].split("-"))
                inside = low <= address < high
                if inside:
                    found = (int(fields[4]), fields[5] if len(fields) > 5 else "", 0)
            elif inside and fields[0] == "Anonymous:":
                found = (found[0], found[1], int(fields[1]))
    return found


def make_x(holding):
    """A 2-D float64 array of 32 MiB, held once (made so that it can be) or ordinary (it will be dumped)."""
    if holding == "held":
        return _shape_of(array_fit_to_hold(32 * MIB, seed=1))
    return _shape_of(np.random.default_rng(1).random(32 * MIB // 8))


def run(transport, func, x):
    """``func(x, i)`` for each of ``TASKS`` tasks, one call a task."""
    if transport == "parallel":
        return Parallel(n_jobs=2, batch_size=1)(delayed(func)(x, i) for i in range(TASKS))
    with MemmappingPool(2) as pool:
        return pool.starmap(func, [(x, i) for i in range(TASKS)], chunksize=1)


def ignoring_index(func):
    def call(x, _):
        return func(x)

    return call


@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("holding", ["held", "dumped"])
@pytest.mark.parametrize("transport", ["parallel", "pool"])
def test_results_viewing_an_argument_map_its_file_and_are_arrays_of_their_own(
    mechanism, monkeypatch, transport, holding, view
):
    monkeypatch.setenv("MEMSHARE_PROMOTE", "1" if holding == "held" else "0")
    before = own_files()
    x = make_x(holding)
    original = x.copy()
    func = VIEWS[view]
    results = run(transport, ignoring_index(func), x)
    stats = memshare.last_call_stats()
    expected = func(original)
    held = _held_once.lookup(x.base)
    assert (held is not None) == (holding == "held")
    assert stats["results_of_inputs"] == TASKS and stats["bytes_results_of_inputs"] == TASKS * expected.nbytes
    assert stats["results_by_reference"] == 0  # no result file was made
    # Each result maps the argument's file itself, one file for all: no copy, nothing private yet.
    maps = [mapping_at(result.ctypes.data) for result in results]
    inodes = {inode for inode, _, _ in maps}
    assert len(inodes) == 1, maps
    names = {name for _, name, _ in maps}
    kind = HELD if holding == "held" else DUMP
    assert all(f"{kind}-" in name for name in names), names
    if held is not None:
        assert inodes == {held.ref.inode}
    assert all(private == 0 for _, _, private in maps)
    for result in results:
        assert type(result) is np.ndarray and result.flags.writeable
        np.testing.assert_array_equal(result, expected)
    # A write into a result changes neither the argument nor another result.
    results[0][0] = -1.0
    assert x[0, -1] == original[0, -1] and x[0, 0] == original[0, 0]
    np.testing.assert_array_equal(results[1], expected)
    # A later write into the argument changes no result.
    x[:] = -2.0
    for result in results[1:]:
        np.testing.assert_array_equal(result, expected)
    del x, results, held
    gc.collect()
    assert own_files() == before


def write_then_return(x, i):
    x[i] = -1.0 - i
    return x


@pytest.mark.parametrize("holding", ["held", "dumped"])
def test_under_copy_on_write_an_argument_returned_unwritten_is_its_file_and_a_written_one_a_copy(
    default_location, monkeypatch, holding
):
    # mmap_mode="c" maps the argument privately in the worker: its file is its content only while no page is written.
    monkeypatch.setenv("MEMSHARE_PROMOTE", "1" if holding == "held" else "0")
    x = make_x(holding)
    original = x.copy()
    returned = Parallel(n_jobs=2, batch_size=1, mmap_mode="c")(delayed(whole)(x) for _ in range(TASKS))
    stats = memshare.last_call_stats()
    assert stats["results_of_inputs"] == TASKS and stats["results_by_reference"] == 0, stats
    assert len({mapping_at(r.ctypes.data)[0] for r in returned}) == 1
    written = Parallel(n_jobs=2, batch_size=1, mmap_mode="c")(delayed(write_then_return)(x, i) for i in range(TASKS))
    stats = memshare.last_call_stats()
    assert stats["results_of_inputs"] == 0 and stats["results_by_reference"] == TASKS, stats
    for i, result in enumerate(written):
        expected = original.copy()
        expected[i] = -1.0 - i
        np.testing.assert_array_equal(result, expected)
    returned[0][:] = 3.0
    np.testing.assert_array_equal(x, original)
    np.testing.assert_array_equal(returned[1], original)


def test_a_task_error_leaves_nothing(mechanism):
    before = own_files()
    x = make_x("held")
    with pytest.raises(ValueError, match="task 3 fails"):
        Parallel(n_jobs=2, batch_size=1)(delayed(whole_or_fail)(x, i) for i in range(TASKS))
    del x
    gc.collect()
    assert own_files() == before


def test_a_killed_worker_leaves_nothing(mechanism, monkeypatch):
    monkeypatch.setenv("MEMSHARE_PROMOTE", "0")
    before = own_files()
    x = make_x("dumped")
    with pytest.raises(memshare.WorkerDiedError, match="SIGKILL"):
        Parallel(n_jobs=2, batch_size=1)(delayed(whole_or_die)(x, i) for i in range(TASKS))
    with pytest.raises(memshare.WorkerDiedError):
        with MemmappingPool(2) as pool:
            pool.starmap(whole_or_die, [(x, i) for i in range(TASKS)], chunksize=1)
    del x
    gc.collect()
    assert own_files() == before


def test_a_view_of_the_argument_kept_from_an_earlier_task_is_copied():
    # The file it views may be gone by the time the outcome is restored: only the task's own are referenced.
    with MemmappingPool(1, promote=False) as pool:
        x = np.arange(300_000.0)
        pool.apply(keep, (x,))
        (kept,) = pool.map(return_kept, [0])
    stats = memshare.last_call_stats()
    assert stats["results_of_inputs"] == 0 and stats["results_by_reference"] == 1
    np.testing.assert_array_equal(kept, x)


def array_of(obj):
    return obj["x"]


def test_an_array_inside_an_argument_object_comes_back(default_location):
    # The object's dump, not the task, keeps the dumps its payload names: such a view is copied, never refused.
    x = np.arange(300_000.0)
    obj = {"x": x, "text": "a" * 2**21}
    results = Parallel(n_jobs=2, batch_size=1)(delayed(array_of)(obj) for _ in range(4))
    assert memshare.last_call_stats()["objects_dumped"] == 1
    for result in results:
        np.testing.assert_array_equal(result, x)


_kept = []


def keep(x):
    _kept.append(x)


def return_kept(_):
    return _kept[0]


# -- the parent maps only its own files, and only those the task was given ------


@pytest.fixture
def session(default_location):
    session = Session(Settings.from_user("1M", "r", None, False))
    yield session
    session.close()


def forged(outcome, **changes):
    """``outcome`` with its one slot changed."""
    return dataclasses.replace(outcome, slots=(dataclasses.replace(outcome.slots[0], **changes),))


def test_an_outcome_naming_the_tasks_dump_is_mapped_copy_on_write_counted_and_logged(session, caplog):
    x = np.arange(300_000.0)
    task = session.pack_task(whole, (x,))
    with caplog.at_level(logging.DEBUG, logger="memshare"):
        outcome = run_task(task)  # in this process: it maps the session's dump as a worker would
    assert outcome.slots[0].kind == DUMP
    assert "returned by reference to its input" in caplog.text
    ok, value = session.finish(outcome)
    assert ok and value.flags.writeable
    assert session.stats.as_dict()["results_of_inputs"] == 1
    np.testing.assert_array_equal(value, x)
    value[0] = 5.0
    assert x[0] == 0.0


def test_an_outcome_naming_a_file_its_task_was_not_given_is_refused(session, tmp_path):
    x, y = np.arange(300_000.0), np.ones(300_000)
    given = run_task(session.pack_task(whole, (x,)))
    other = session.pack_task(whole, (y,))
    # A dump of the session, but another task's, gone since (that task done, its array collected): refused.
    session.task_done(given.token)
    del x
    gc.collect()
    ok, error = session.finish(dataclasses.replace(given, token=other.token))
    assert not ok and isinstance(error, PermissionError) and "was not given" in str(error)
    # Any other file, whatever its kind says: refused, not opened.
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\1" * 8 * 1000)
    info = os.stat(secret)
    third = session.pack_task(whole, (y,))
    for kind in (DUMP, HELD):
        outcome = Outcome(third.token, True, given.stream, slots=(ArrayRef.in_file(
            str(secret), info, kind=kind, mode="r", offset=0, shape=(1000,), strides=(8,), dtype=np.dtype("f8")
        ),))  # fmt: skip
        ok, error = session.finish(outcome)
        assert not ok and isinstance(error, PermissionError)
        third = session.pack_task(whole, (y,))
    assert secret.read_bytes() == b"\1" * 8 * 1000
    session.task_done(third.token)


def test_the_tasks_files_are_released_after_its_outcome_is_restored(session):
    x = np.arange(300_000.0)
    outcome = run_task(session.pack_task(whole, (x,)))
    ok, value = session.finish(outcome)
    assert ok
    # The task is done: its record is gone, so the same outcome again is refused.
    ok, error = session.finish(outcome)
    assert not ok and isinstance(error, PermissionError)
    np.testing.assert_array_equal(value, x)
