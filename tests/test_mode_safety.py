"""The mmap_mode rule on every route: a worker never writes into the parent's own array.

``mmap_mode='r+'``/``'w+'`` let the workers of a call share writes to a dump,
never to the parent's original array (README). An array held once
(``_held_once``) is the parent's memory: its file must never reach a worker
with a writable mode, whatever an earlier call held. These tests also pin
what an earlier call's decision may and may not change in a later call with
other settings (``mmap_mode``, ``max_nbytes``, ``promote``, ``temp_folder``).
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
import zlib

import joblib
import numpy as np
import pytest
from conftest import array_fit_to_hold
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import memshare
from memshare import MemmappingPool, Parallel, delayed
from memshare._parent import _held_memory, _held_once

MIB = 1024**2
#: Above glibc's largest dynamic mmap threshold (32 MiB on 64-bit): such an
#: array always gets a mapping of its own, so it can be held once however
#: earlier tests of this process freed memory.
SIZE = 33 * MIB

_can_hold = sys.platform.startswith("linux") and _held_memory.unsupported_reason() is None
needs_holding = pytest.mark.skipif(
    not _can_hold, reason=f"arrays cannot be held once here: {_held_memory.unsupported_reason()}"
)


@pytest.fixture(autouse=True)
def _default_location(default_location):
    """memshare chooses the location, so that arrays are held once (see test_held_once)."""


def fresh(extra: int = 0, seed: int = 0) -> np.ndarray:
    """A new ordinary array of a little over ``SIZE`` bytes, ``extra`` more elements, that can be held once."""
    return array_fit_to_hold(SIZE + 8 * extra, seed)


def held_array() -> np.ndarray:
    """A new array, held once by a first read-only call (as in the issue's script)."""
    x = fresh()
    Parallel(n_jobs=2)(delayed(checksum)(x) for _ in range(2))
    assert _held_once.lookup(x) is not None
    return x


def checksum(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8))


def scribble(a: np.ndarray) -> bool:
    """Write into the task's argument in place when the worker may; True if it wrote."""
    if not a.flags.writeable:
        return False
    a[:] = -7.0
    return True


def file_and_mode(a: np.ndarray):
    return getattr(a, "filename", None), getattr(a, "mode", None), bool(a.flags.writeable)


def scribble_then_read(a: np.ndarray) -> int:
    scribble(a)
    return checksum(a)


def file_bytes(ref) -> bytes:
    """The bytes of a held array's file (read through its path, as a worker would)."""
    with open(ref.path, "rb") as handle:
        handle.seek(ref.offset)
        return handle.read(ref.nbytes)


# -- item 1: a writable mode after the array was held once -------------------


@needs_holding
@pytest.mark.parametrize("mode", ["r+", "w+"])
@pytest.mark.parametrize("view", [False, True], ids=["array", "large-view"])
def test_a_writable_parallel_call_after_holding_once_leaves_the_parents_array_alone(mode, view):
    x = held_array()
    expected = x.copy()
    argument = x[1:] if view else x  # a large view travels as a view of its base: the same file
    wrote = Parallel(n_jobs=2, mmap_mode=mode)(delayed(scribble)(argument) for _ in range(2))
    assert wrote == [True, True]
    assert np.array_equal(x, expected), f"{int((x == -7.0).sum())} elements written by a worker"
    held = _held_once.lookup(x)
    assert held is not None and file_bytes(held.ref) == expected.tobytes()
    # And a later read-only call still serves the parent's values from the held file.
    assert Parallel(n_jobs=2)(delayed(checksum)(x) for _ in range(2)) == [checksum(expected)] * 2
    assert memshare.last_call_stats()["arrays_dumped"] == 0


@needs_holding
@pytest.mark.parametrize("mode", ["r+", "w+"])
def test_a_writable_pool_after_a_call_held_the_array_leaves_the_parents_array_alone(mode):
    x = held_array()
    expected = x.copy()
    with MemmappingPool(2, mmap_mode=mode) as pool:
        assert pool.map(scribble, [x, x]) == [True, True]
        assert np.array_equal(x, expected)
        # Within the pool, r+ shares writes among its tasks, as documented; the
        # next method call compares the dump with the parent and writes it again.
        assert pool.map(checksum, [x]) == [checksum(expected)]
    assert np.array_equal(x, expected)


@needs_holding
def test_a_writable_call_dumps_a_held_array_and_the_log_says_why(caplog):
    x = held_array()
    with caplog.at_level("DEBUG", logger="memshare"):
        Parallel(n_jobs=2, mmap_mode="r+")(delayed(checksum)(x) for _ in range(2))
    assert memshare.last_call_stats()["arrays_dumped"] == 1
    assert any(
        "not held once" in r.getMessage() and "their writes would reach" in r.getMessage() for r in caplog.records
    )


@needs_holding
def test_a_held_file_is_never_referenced_with_a_writable_mode():
    x = held_array()
    held = _held_once.lookup(x)
    assert [held.reference(mode).mode for mode in ("r", "c")] == ["r", "c"]
    with pytest.raises(ValueError, match="their writes would reach the parent's array"):
        held.reference("r+")


@needs_holding
def test_copy_on_write_sends_the_held_file_and_the_workers_writes_stay_private():
    x = held_array()
    expected = x.copy()
    held = _held_once.lookup(x)
    seen = Parallel(n_jobs=2, mmap_mode="c")(delayed(file_and_mode)(x) for _ in range(2))
    assert seen == [(held.ref.path, "c", True)] * 2  # no dump: the held file itself, mapped privately
    results = Parallel(n_jobs=2, mmap_mode="c")(delayed(scribble_then_read)(x) for _ in range(2))
    assert results == [checksum(np.full_like(x, -7.0))] * 2  # each task saw its own writes
    assert np.array_equal(x, expected)
    assert file_bytes(held.ref) == expected.tobytes()
    assert Parallel(n_jobs=2)(delayed(checksum)(x) for _ in range(2)) == [checksum(expected)] * 2


# -- item 3: decisions of an earlier call, reused under other settings --------


def test_a_managed_r_plus_context_serves_the_parents_values_after_its_workers_wrote():
    # The dump of an r+ session is written by its workers; the next call of the
    # same session compares it with the parent's array and writes it again.
    x = fresh(seed=1)
    expected = x.copy()
    with Parallel(n_jobs=2, mmap_mode="r+") as parallel:
        assert parallel(delayed(scribble)(x) for _ in range(2)) == [True, True]
        assert parallel(delayed(checksum)(x) for _ in range(2)) == [checksum(expected)] * 2
    assert np.array_equal(x, expected)


def test_a_copy_on_write_memmaps_dump_follows_its_current_writeable_flag(tmp_path):
    # A copy-on-write memmap is copied, and tasks map the copy as the memmap
    # allows: 'c' while it is writable, 'r' once it is made read-only. A dump
    # made in one call of a session is reused by the next: with the mode the
    # array has now, not the mode it had then.
    path = tmp_path / "data.bin"
    fresh(seed=2)[: 2 * MIB // 8].tofile(path)
    m = np.memmap(path, dtype=np.float64, mode="c")
    m[0] = -m[0]  # written in this process: copied (an unwritten one goes by reference, as a file)
    with Parallel(n_jobs=2, max_nbytes="1M") as parallel:
        first = parallel(delayed(file_and_mode)(m) for _ in range(2))
        m.flags.writeable = False
        second = parallel(delayed(file_and_mode)(m) for _ in range(2))
    assert [writeable for _, _, writeable in first] == [True, True]
    assert [writeable for _, _, writeable in second] == [False, False]
    # One dump for the session's two calls, its file reused with the new mode.
    assert first[0][0] == second[0][0] and memshare.last_call_stats()["arrays_dumped"] == 1
    del m


@needs_holding
def test_a_held_array_is_dumped_when_a_later_call_turns_held_once_off():
    # promote=False is the documented way out of holding once: that call gets a
    # plain dump even for an array an earlier call held (which stays held).
    x = held_array()
    with joblib.parallel_config(backend="memshare", promote=False):
        files = Parallel(n_jobs=2)(delayed(file_and_mode)(x) for _ in range(2))
    assert memshare.last_call_stats()["arrays_dumped"] == 1
    held = _held_once.lookup(x)
    assert held is not None and {name for name, _, _ in files} != {held.ref.path}


@needs_holding
def test_a_held_array_travels_by_reference_when_a_later_call_names_a_temp_folder(tmp_path):
    # temp_folder says where memshare writes a call's files; an array held once
    # needs no new file (its memory is already in shared memory), so it is sent
    # as it is, read-only or copy-on-write, and nothing is written to the folder.
    x = held_array()
    held = _held_once.lookup(x)
    for mode in ("r", "c"):
        seen = Parallel(n_jobs=2, temp_folder=str(tmp_path), mmap_mode=mode)(
            delayed(file_and_mode)(x) for _ in range(2)
        )
        assert {name for name, _, _ in seen} == {held.ref.path}
        assert memshare.last_call_stats()["arrays_dumped"] == 0
    expected = x.copy()
    Parallel(n_jobs=2, temp_folder=str(tmp_path), mmap_mode="r+")(delayed(scribble)(x) for _ in range(2))
    assert np.array_equal(x, expected)


# -- item 4: the property -----------------------------------------------------

_MODES = ("r", "c", "r+", "w+")
_REGIONS = ("none", "first", "interior", "last", "all")

_call = st.fixed_dictionaries(
    {
        "mode": st.sampled_from(_MODES),
        "dump": st.booleans(),  # max_nbytes below the array's size (dumped or held once) or above (pickled)
        "promote": st.booleans(),
        "write": st.booleans(),  # the tasks write into their argument in place, or read it
        "view": st.booleans(),  # the argument is the array or a large view of it
        "parent_writes": st.sampled_from(_REGIONS),  # what the parent rewrites in place before the call
    }
)


def _parent_write(x: np.ndarray, region: str, value: float) -> None:
    """The parent's own in-place write between calls: the first, an interior, the last page, or everything."""
    page = _held_memory.PAGE // x.itemsize
    if region == "first":
        x[:3] = value
    elif region == "interior":
        x[x.size // 2 : x.size // 2 + 3 * page] = value
    elif region == "last":
        x[-3:] = value
    elif region == "all":
        x += value


def _issue_script():
    base = {"dump": True, "promote": True, "view": False, "parent_writes": "none"}
    return [dict(base, mode="r", write=False), dict(base, mode="r+", write=True), dict(base, mode="r", write=False)]


# Version-independent: a search over call sequences, a soak of memshare's own bookkeeping; what each mode does
# with the versions at hand is this file's other tests and test_raw_mmap's, which run everywhere.
@pytest.mark.version_independent
@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,  # the same examples on every run: no flaky CI, failures reproduce
    database=None,  # leaves no .hypothesis folder in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@example(calls=_issue_script(), extra=0)
@given(calls=st.lists(_call, min_size=2, max_size=4), extra=st.integers(0, 1000))
def test_workers_never_change_the_parents_array_and_always_see_its_current_values(calls, extra):
    """Any sequence of calls over one array, with any settings: a worker's writes never reach the parent.

    The array is ordinary memory (the user's own ``np.memmap`` and shared
    arrays are the shared-write cases, out of scope), so whatever a call held
    or dumped before, and whatever the parent wrote since, every task reads
    the parent's current values and no task's write is seen by the parent.
    """
    _run_calls(fresh(extra), calls, SIZE)


#: The user's own mappings of a file the property also covers: shared, or private (``mmap.ACCESS_COPY``).
_RAW_ACCESS = {"shared": mmap.ACCESS_WRITE, "private": mmap.ACCESS_COPY}
_RAW_SIZE = 4 * MIB


@pytest.mark.parametrize("access", sorted(_RAW_ACCESS))
@settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(calls=st.lists(_call, min_size=2, max_size=4), extra=st.integers(0, 1000))
def test_the_same_holds_for_an_array_over_the_users_mmap(tmp_path, access, calls, extra):
    """The property above for an array over the user's ``mmap.mmap`` of a file, shared or private.

    Such an array has no mode of its own, as an ordinary array: workers map
    its file with the call's mode, or get a copy (a private mapping the
    parent wrote to; any call with 'r+'/'w+'). The file changes only through
    the parent's own writes, and never under a private mapping.
    """
    path = tmp_path / f"raw-{access}-{len(calls)}-{extra}-{os.urandom(4).hex()}.f8"
    original = np.random.default_rng(extra).random(_RAW_SIZE // 8 + extra)
    original.tofile(path)
    with open(path, "r+b") as handle:
        raw = mmap.mmap(handle.fileno(), 0, access=_RAW_ACCESS[access])
    x = np.frombuffer(raw, dtype=np.float64)
    try:
        _run_calls(x, calls, _RAW_SIZE)
        on_file = np.fromfile(path, dtype=np.float64)
        assert np.array_equal(on_file, x if access == "shared" else original), "the file holds foreign values"
    finally:
        del x
        path.unlink()


def _run_calls(x: np.ndarray, calls, size: int) -> None:
    """Run ``calls`` over ``x`` (of about ``size`` bytes): tasks read its current values, and never change it."""
    shadow = x.copy()  # what the parent's array must hold; never sent
    for step, call in enumerate(calls):
        _parent_write(x, call["parent_writes"], float(step + 1))
        _parent_write(shadow, call["parent_writes"], float(step + 1))
        argument, expected = (x[1:], shadow[1:]) if call["view"] else (x, shadow)
        max_nbytes = size // 2 if call["dump"] else 2 * size
        task = scribble if call["write"] else checksum
        with joblib.parallel_config(backend="memshare", promote=call["promote"]):
            results = memshare.Parallel(n_jobs=2, mmap_mode=call["mode"], max_nbytes=max_nbytes)(
                delayed(task)(argument) for _ in range(2)
            )
        if not call["write"]:
            assert results == [checksum(expected)] * 2, f"call {step} ({call}) read stale or foreign values"
        assert np.array_equal(x, shadow), (
            f"call {step} ({call}) changed the parent's array: {int((x != shadow).sum())} elements"
        )


# -- the property with tasks still pending ----------------------------------------

_step = st.one_of(
    st.just(("submit",)),
    st.tuples(st.just("write"), st.sampled_from(_REGIONS[1:])),
    st.just(("finish",)),  # the oldest pending task may end
)


def checksum_when(a: np.ndarray, go: str, started: str) -> int:
    """``checksum(a)`` once the file ``go`` exists: a task that stays pending while the parent goes on."""
    open(started, "w").close()
    deadline = 60.0
    while not os.path.exists(go) and deadline > 0:
        deadline -= 0.01
        time.sleep(0.01)
    return checksum(a)


class _Pending:
    """Tasks submitted and not finished yet, oldest first, each with the checksum it must return."""

    def __init__(self, folder) -> None:
        self.folder = folder
        self.tasks = []
        self.count = 0

    def files(self):
        self.count += 1
        return str(self.folder / f"go-{self.count}"), str(self.folder / f"started-{self.count}")

    def finish_oldest(self) -> None:
        go, result, expected = self.tasks.pop(0)
        open(go, "w").close()
        assert result() == expected, "a task read values other than those of its submission"

    def finish_all(self) -> None:
        while self.tasks:
            self.finish_oldest()


def _interleave(x: np.ndarray, steps, submit, pending: _Pending) -> None:
    shadow = x.copy()
    try:
        for number, step in enumerate(steps):
            if step[0] == "write":
                _parent_write(x, step[1], float(number + 1))
                _parent_write(shadow, step[1], float(number + 1))
            elif step[0] == "finish" and pending.tasks:
                pending.finish_oldest()
            elif step[0] == "submit":
                submit(checksum(shadow))
        pending.finish_all()
    finally:
        for go, *_ in pending.tasks:
            open(go, "w").close()
    assert np.array_equal(x, shadow), "the parent's array lost a write"


_PENDING_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@settings(max_examples=12, **_PENDING_SETTINGS)
@given(
    steps=st.lists(_step, min_size=3, max_size=8),
    mode=st.sampled_from(("r", "c")),
    promote=st.booleans(),
)
def test_pool_tasks_see_their_submissions_values_while_earlier_ones_are_pending(tmp_path_factory, steps, mode, promote):
    """Any interleaving of apply_async, parent writes and finished tasks: each task reads its submission's values."""
    x = fresh()
    pending = _Pending(tmp_path_factory.mktemp("pool"))
    with MemmappingPool(3, mmap_mode=mode, promote=promote) as pool:

        def submit(expected: int) -> None:
            go, started = pending.files()
            result = pool.apply_async(checksum_when, (x, go, started))
            pending.tasks.append((go, lambda: result.get(60), expected))

        _interleave(x, steps, submit, pending)


@settings(max_examples=8, **_PENDING_SETTINGS)
@given(steps=st.lists(_step, min_size=3, max_size=7), mode=st.sampled_from(("r", "c")), promote=st.booleans())
def test_parallel_calls_see_their_values_while_earlier_calls_tasks_are_pending(tmp_path_factory, steps, mode, promote):
    """The same for calls of ``memshare.Parallel`` in threads, at most two pending (two workers)."""
    x = fresh()
    pending = _Pending(tmp_path_factory.mktemp("calls"))

    def submit(expected: int) -> None:
        if len(pending.tasks) == 2:
            pending.finish_oldest()
        go, started = pending.files()
        results = {}

        def call() -> None:
            with joblib.parallel_config(backend="memshare", promote=promote):
                results["value"] = memshare.Parallel(n_jobs=2, mmap_mode=mode, max_nbytes="1M")(
                    delayed(checksum_when)(x, go, started) for _ in range(1)
                )[0]

        thread = threading.Thread(target=call)
        thread.start()
        deadline = time.monotonic() + 60  # packed once its task runs: only then is the snapshot taken
        while not os.path.exists(started) and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        pending.tasks.append((go, lambda: (thread.join(60), results.get("value"))[1], expected))

    _interleave(x, steps, submit, pending)
