"""Arrays held once: a large ordinary array, once sent, keeps its data in its shared file."""

import ctypes
import gc
import logging
import os
import shutil
import signal
import sys
import threading

import numpy as np
import psutil
import pytest
from conftest import made_where_glibc_maps_it, total, wait_until

import memshare
from memshare import MemmappingPool, Parallel, delayed
from memshare._lifetime import _memfd
from memshare._parent import _held_memory, _held_once
from memshare._transport import _pages
from memshare._transport._refs import HELD

_NO_COMPILER = shutil.which("cc") is None and shutil.which("gcc") is None
pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="arrays are held once on Linux only"),
    pytest.mark.skipif(
        _NO_COMPILER and _held_memory.unsupported_reason() is not None,
        reason=f"arrays cannot be held once here: {_held_memory.unsupported_reason()}",
    ),
]

MIB = 1024**2


def big(mib=48, seed=0):
    """A fresh array that glibc served with a mapping of its own, so that it can be held once (see conftest)."""
    return made_where_glibc_maps_it(
        lambda: np.random.default_rng(seed).random(mib * MIB // 8),
        lambda array: _held_memory.mmapped_chunk(array.ctypes.data, array.nbytes),
        mib * MIB,
    )


def value_at(x, i):
    return float(x[i])


def file_of(x):
    return x.filename, type(x).__name__


def mappings_of(start, end):
    """(names of the mappings over [start, end), their private anonymous kB), from /proc/self/smaps."""
    names, private, inside = set(), 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                low, high = (int(part, 16) for part in fields[0].split("-"))
                inside = low < end and high > start
                if inside:
                    names.add(fields[5] if len(fields) > 5 else "")
            elif inside and fields[0] == "Anonymous:":
                private += int(fields[1])
    return names, private


def anon_kib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


def _own_named_files():
    """Paths of the files in this process's memshare folders in /dev/shm (folders carry the owner's pid)."""
    paths = []
    for entry in os.listdir("/dev/shm"):
        folder = os.path.join("/dev/shm", entry)
        if entry.startswith(f"memshare-{os.getpid()}-") and os.path.isdir(folder):
            try:
                paths += [os.path.join(folder, name) for name in os.listdir(folder)]
            except FileNotFoundError:
                pass
    return paths


def _own_files():
    return _memfd.held_paths() + _own_named_files()


def held_files():
    """This process's held files: memfds it holds open, and named files in its /dev/shm folders."""
    memfds = [path for path in _memfd.held_paths() if _memfd.kind_of(path) == HELD]
    return memfds + [path for path in _own_named_files() if os.path.basename(path).startswith(HELD)]


def own_shared_kib():
    """Shared memory held by this process's memshare files: its memfds and its named files."""
    total = 0
    for path in _own_files():
        try:
            total += os.stat(path).st_blocks // 2
        except FileNotFoundError:
            pass
    return total


def name_in_maps(path):
    """How a file shows in /proc/<pid>/maps: a memfd by its name, a named file by its path."""
    return os.readlink(path).split(" ")[0] if _memfd.is_memfd_path(path) else path


@pytest.fixture(autouse=True)
def _default_location(default_location):
    """Arrays are held once only where memshare chooses the location."""


def test_this_linux_process_can_hold_arrays_once():
    # Where a C compiler exists (CI), the C helper must have been built (the
    # module is skipped, saying why, only where there is none).
    assert _held_memory.unsupported_reason() is None


def test_a_sent_array_becomes_its_file_with_its_values_address_and_flags_unchanged(mechanism):
    x = big()
    expected = x.copy()
    address = x.ctypes.data
    with MemmappingPool(2) as pool:
        files = pool.map(file_of, [x, x])
    stats = memshare.last_call_stats()
    held = _held_once.lookup(x)
    assert held is not None and _memfd.is_memfd_path(held.ref.path) == (mechanism == "memfd")
    assert all(name == held.ref.path and kind == "memmap" for name, kind in files)
    assert stats["arrays_held_once"] == 1 and stats["bytes_held_once"] == x.nbytes and stats["arrays_dumped"] == 0
    assert x.ctypes.data == address and x.flags.owndata and x.flags.writeable and x.base is None
    np.testing.assert_array_equal(x, expected)
    # The parent's own copy is gone: the array's whole pages map its file, with no private page.
    names, private = mappings_of(held.first_page, held.end_page)
    assert names == {name_in_maps(held.ref.path)} and private == 0
    assert _pages.changed_pages(held.first_page, held.end_page).size == 0


def test_changes_between_calls_are_seen_and_written_back_to_the_file():
    x = big()
    inner, last = 100_000, x.size - 1
    assert Parallel(n_jobs=2)(delayed(value_at)(x, i) for i in (0, inner)) == [x[0], x[inner]]
    held = _held_once.lookup(x)
    assert held is not None
    x[inner] = -1.0  # an interior page
    x[0] = -2.0  # the first, partly filled page stays ordinary memory
    x[last] = -3.0  # and so does the last
    assert _pages.changed_pages(held.first_page, held.end_page).size == 1
    results = Parallel(n_jobs=2)(delayed(value_at)(x, i) for i in (0, inner, last))
    assert results == [-2.0, -1.0, -3.0]
    stats = memshare.last_call_stats()
    assert stats["arrays_dumped"] == 0 and stats["bytes_refreshed"] > 0
    # The rewritten page is a file page again: the parent does not keep a second copy of it.
    assert _pages.changed_pages(held.first_page, held.end_page).size == 0
    assert _held_once.lookup(x) is held


def test_a_managed_context_sees_an_in_place_change_between_its_calls():
    x = big()
    with Parallel(n_jobs=2) as parallel:
        assert parallel(delayed(total)(x) for _ in range(2)) == [pytest.approx(x.sum())] * 2
        x *= 2.0
        assert parallel(delayed(total)(x) for _ in range(2)) == [pytest.approx(x.sum())] * 2


def wait_then_read(x, started, go):
    open(started, "w").close()
    assert wait_until(lambda: os.path.exists(go), 60)
    return float(x[1000])


def test_a_parent_write_during_a_call_stays_private_to_the_parent(tmp_path):
    x = big()
    original = float(x[1000])
    started, go = str(tmp_path / "started"), str(tmp_path / "go")
    with MemmappingPool(1) as pool:
        pending = pool.apply_async(wait_then_read, (x, started, go))
        assert wait_until(lambda: os.path.exists(started), 60)
        x[1000] = 12345.0
        open(go, "w").close()
        assert pending.get(60) == original
    assert x[1000] == 12345.0


def test_a_forked_childs_write_leaves_the_parents_values_unchanged(mechanism):
    x = big()
    Parallel(n_jobs=2)(delayed(value_at)(x, i) for i in (0, 1))
    held = _held_once.lookup(x)
    assert held is not None
    expected = x.copy()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        x[:] = 7.0
        os._exit(0 if float(x[5]) == 7.0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    np.testing.assert_array_equal(x, expected)
    # The child dropped its copy of the registry without freeing the parent's file (old loky releases
    # fork every worker this way before exec): the next call still reads it.
    path_before = held.ref.path
    assert held_files() == [path_before]
    x[100_000] = -5.0
    assert Parallel(n_jobs=2)(delayed(value_at)(x, i) for i in (100_000, 0)) == [-5.0, x[0]]
    # The change moved the array to a new file; the old one went, since no task reads it.
    assert memshare.last_call_stats()["arrays_dumped"] == 0 and memshare.last_call_stats()["bytes_refreshed"] > 0
    assert held_files() == [held.ref.path] != [path_before]


@pytest.mark.parametrize("fork", ["os.fork", "fork() from C"])
def test_a_change_after_a_fork_goes_to_a_new_file_so_the_childs_view_stays_as_at_the_fork(fork):
    # A child forked by C code runs none of Python's fork hooks: memshare cannot count it, and
    # must not need to (a held file is never written again).
    x = big()
    Parallel(n_jobs=2)(delayed(value_at)(x, i) for i in (0, 1))
    path_before = _held_once.lookup(x).ref.path
    before = x[4096:8192].copy()
    # The child only waits: the parent reads the child's view of x through /proc/<pid>/mem. A child forked
    # from C may never run Python again (it holds the GIL the fork copied, but CPython, not told of the fork,
    # gives it up to a parent's thread the child does not have as soon as one had asked for it), so it must
    # not have to; it is killed at the end whatever it is doing.
    libc = ctypes.PyDLL(None)
    pid = os.fork() if fork == "os.fork" else libc.fork()
    if pid == 0:  # pragma: no cover - the child
        while True:
            libc.pause()
    try:
        x[4096:8192] = -9.0  # whole pages of the file mapping
        results = Parallel(n_jobs=2)(delayed(value_at)(x, i) for i in (5000, 0))
        stats = memshare.last_call_stats()
        path_after = _held_once.lookup(x).ref.path
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as memory:
            memory.seek(x[4096:].__array_interface__["data"][0])
            seen = memory.read(before.nbytes)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert results == [-9.0, x[0]]
    assert seen == before.tobytes(), "the child saw the parent's change"
    assert stats["arrays_dumped"] == 0 and stats["bytes_refreshed"] == x.nbytes and path_after != path_before


def test_freeing_the_array_frees_its_file_and_the_workers_mappings(mechanism):
    x = big()
    with MemmappingPool(2) as pool:
        pool.map(total, [x, x])
        path = _held_once.lookup(x).ref.path
        name = name_in_maps(path)
        workers = [child.pid for child in psutil.Process().children(recursive=True)]
        assert workers and any(_maps(pid, name) for pid in workers)
        assert held_files() == [path]
        del x
        gc.collect()
        assert held_files() == []  # at once: the array's weak reference callback freed it
        # The workers dropped their mappings of the freed file.
        assert wait_until(lambda: not any(_maps(pid, name) for pid in workers), 10.0)


def _maps(pid, name):
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return any(name in line for line in maps)
    except OSError:
        return False


@pytest.mark.version_independent  # a soak: hundreds of arrays through one mechanism
def test_many_distinct_arrays_leave_no_file_and_no_memory_behind(mechanism):
    with MemmappingPool(2) as pool:
        pool.map(total, [big(40, seed=1)])  # workers started and warm
        gc.collect()
        shared_before, anon_before = own_shared_kib(), anon_kib()
        held = 0
        for seed in range(200):
            pool.map(total, [np.random.default_rng(seed).random(4 * MIB // 8)] * 2)
            held += memshare.last_call_stats()["arrays_held_once"]
        for seed in range(20):  # above glibc's largest mmap threshold: always a mapping of its own
            pool.map(total, [big(40, seed=seed)] * 2)
            held += memshare.last_call_stats()["arrays_held_once"]
        gc.collect()
        assert held >= 20
        assert not held_files()
        assert own_shared_kib() <= shared_before
        assert anon_kib() - anon_before < 16 * 1024


def test_threads_writing_during_calls_never_lose_a_write():
    x = big(64)
    stop = threading.Event()
    last = {}

    def writer():
        rng = np.random.default_rng(1)
        value = 0.0
        while not stop.is_set():
            i = int(rng.integers(0, x.size))
            value += 1.0
            x[i] = value
            last[i] = value

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(6):  # the first call promotes; the others refresh while the writer writes
            Parallel(n_jobs=2)(delayed(total)(x) for _ in range(2))
    finally:
        stop.set()
        thread.join()
    assert _held_once.lookup(x) is not None
    indexes = np.fromiter(last, dtype=np.int64)
    np.testing.assert_array_equal(x[indexes], np.fromiter(last.values(), dtype=np.float64))


def test_memshare_promote_0_and_promote_false_keep_the_plain_dump(monkeypatch):
    x = big()
    monkeypatch.setenv("MEMSHARE_PROMOTE", "0")
    Parallel(n_jobs=2)(delayed(total)(x) for _ in range(2))
    assert _held_once.lookup(x) is None and memshare.last_call_stats()["arrays_dumped"] == 1
    monkeypatch.delenv("MEMSHARE_PROMOTE")
    with MemmappingPool(2, promote=False) as pool:
        pool.map(total, [x])
    assert _held_once.lookup(x) is None and memshare.last_call_stats()["arrays_dumped"] == 1
    import joblib

    with joblib.parallel_config(backend="memshare", promote=False):
        joblib.Parallel(n_jobs=2)(delayed(total)(x) for _ in range(2))
    assert _held_once.lookup(x) is None and memshare.last_call_stats()["arrays_dumped"] == 1
    Parallel(n_jobs=2)(delayed(total)(x) for _ in range(2))
    assert _held_once.lookup(x) is not None


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_a_bad_memshare_promote_names_the_fix(monkeypatch, value):
    monkeypatch.setenv("MEMSHARE_PROMOTE", value)
    with pytest.raises(ValueError, match="MEMSHARE_PROMOTE.*set it to 1"):
        MemmappingPool(1)


def test_a_bad_promote_argument_names_the_fix():
    with pytest.raises(TypeError, match="promote must be True, False or None"):
        MemmappingPool(1, promote="yes")


@pytest.mark.parametrize(
    "make, kwargs, reason",
    [
        (lambda: big(), {"mmap_mode": "r+"}, "their writes would reach"),
        (lambda: big()[: 2 * MIB], {}, "does not own its memory"),  # a small view: dumped alone
        (lambda: np.random.default_rng(0).random(15000), {"max_nbytes": 1000}, "malloc chunk"),
    ],
)
def test_arrays_that_cannot_be_held_once_are_dumped_and_the_log_says_why(make, kwargs, reason, caplog):
    x = make()
    with caplog.at_level(logging.DEBUG, logger="memshare"):
        with MemmappingPool(2, **kwargs) as pool:
            assert pool.map(total, [x]) == [pytest.approx(float(x.sum()))]
    assert _held_once.lookup(x) is None
    assert memshare.last_call_stats()["arrays_dumped"] == 1
    assert any("not held once" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_memory_of_another_allocator_is_dumped(monkeypatch, caplog):
    # numpy lets a library plug in its own allocator (NEP 49); memory that
    # numpy's default one did not make is never remapped.
    monkeypatch.setattr(_held_once, "made_by_default_allocator", lambda array: False)
    x = big()
    with caplog.at_level(logging.DEBUG, logger="memshare"):
        Parallel(n_jobs=2)(delayed(total)(x) for _ in range(2))
    assert _held_once.lookup(x) is None and memshare.last_call_stats()["arrays_dumped"] == 1
    assert any("NumPy's default allocator" in r.getMessage() for r in caplog.records)


def test_an_explicit_temp_folder_keeps_the_plain_dump(tmp_path):
    x = big()
    with MemmappingPool(2, temp_folder=str(tmp_path)) as pool:
        pool.map(total, [x])
    assert _held_once.lookup(x) is None


def test_the_decision_log_and_stats_record_each_held_once(caplog):
    x = big()
    with caplog.at_level(logging.DEBUG, logger="memshare"):
        Parallel(n_jobs=2)(delayed(total)(x) for _ in range(3))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("held once")]
    assert len(lines) == 1 and _held_once.lookup(x).ref.path in lines[0]
    assert memshare.last_call_stats()["arrays_held_once"] == 1


def test_numpy_refuses_to_resize_an_array_held_once_in_place():
    # numpy resizes no array that has a weak reference, which holding once
    # needs; np.resize (a copy) works as ever.
    x = big()
    Parallel(n_jobs=2)(delayed(total)(x) for _ in range(2))
    assert _held_once.lookup(x) is not None
    with pytest.raises(ValueError, match="cannot resize"):
        x.resize(x.size * 2, refcheck=False)
    grown = np.resize(x, x.size * 2)
    np.testing.assert_array_equal(grown[: x.size], x)


def test_views_of_an_array_held_once_read_its_file():
    owner = big()
    x = owner.reshape(-1, 8)
    results = Parallel(n_jobs=2)(delayed(file_of)(v) for v in (x, x.T, x[: x.shape[0] // 2 + 1]))
    held = _held_once.lookup(owner)
    assert held is not None and {name for name, _ in results} == {held.ref.path}
    assert Parallel(n_jobs=2)(delayed(total)(v) for v in (x.T, x[::-1])) == [pytest.approx(x.sum())] * 2


def test_unreadable_page_flags_mean_a_plain_dump_never_stale_data(monkeypatch):
    x = big()
    Parallel(n_jobs=2)(delayed(total)(x) for _ in range(2))
    assert _held_once.lookup(x) is not None

    def unreadable(first_page, end):
        raise PermissionError(13, "Permission denied: /proc/self/pagemap")

    monkeypatch.setattr(_pages, "changed_pages", unreadable)
    x[100_000] = -7.0
    assert Parallel(n_jobs=2)(delayed(value_at)(x, i) for i in (100_000, 1)) == [-7.0, x[1]]
    assert memshare.last_call_stats()["arrays_dumped"] == 1


def test_two_threads_promoting_one_array_make_one_file(mechanism):
    arrays = [big()]
    barrier = threading.Barrier(2)
    records = []

    def promote():
        barrier.wait()
        records.append(_held_once.hold(arrays[0])[0])

    threads = [threading.Thread(target=promote) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert records[0] is records[1] and held_files() == [records[0].ref.path]
    arrays.clear()
    records.clear()
    gc.collect()
    assert held_files() == []


def test_an_array_held_once_costs_at_most_one_descriptor(mechanism):
    arrays = [big(34, seed=seed) for seed in range(7)]
    _held_once.hold(arrays.pop())  # the first one may start the folder's watchdog (a pipe)
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for array in arrays:
        _held_once.hold(array)
    del array
    grown = len(os.listdir("/proc/self/fd")) - before
    assert grown == (len(arrays) if mechanism == "memfd" else 0)
    arrays.clear()
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before
