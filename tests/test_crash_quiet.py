"""Crashes, interrupts, a tmpfs filling up under our feet, bounded shared memory, and a quiet stderr.

Every scenario that could hang runs under a generous bound; every process and
mount a test starts is cleaned up by the test itself.
"""

from __future__ import annotations

import errno
import faulthandler
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
from conftest import files_under, memshare_entries, total, wait_until

import memshare
from memshare import MemmappingPool, Parallel, delayed

# Words that must never reach stderr: they mean a leak, a double cleanup or a
# cleanup racing with a worker.
NOISE = ("resource_tracker", "leaked", "KeyError", "FileNotFoundError", "Traceback")

PROMPTLY = 30  # seconds: anything slower is a hang


# -- tasks (module level, so that workers can import them) --------------------


def die_if_shared(x, sig, cue=None):
    """Kill this worker with ``sig``, but only if ``x`` really came as a shared file.

    Otherwise return a marker, so a test whose array was not dumped fails
    instead of passing without ever having had files to clean. With a folder
    ``cue``, the task first says it started (a file named after its pid) and
    waits for a file ``go`` there.
    """
    if not (isinstance(x, np.memmap) and x.filename and os.path.exists(x.filename)):
        return "not shared"
    if cue is not None:
        open(os.path.join(cue, str(os.getpid())), "w").close()
        if not wait_until(lambda: os.path.exists(os.path.join(cue, "go")), PROMPTLY):
            return "no go"
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core dump to wait for
    faulthandler.disable()  # pool workers forked from pytest inherit its handler: keep the log readable
    os.kill(os.getpid(), sig)
    time.sleep(PROMPTLY)  # the signal is delivered before this returns
    return "survived"


def total_and_result(x, i):
    """A float, plus a result large enough to come back through a shared file."""
    return float(x.sum()), np.full(300_000, float(i))


def sleep_a_little(x):
    time.sleep(0.002)
    return float(x[0])


# -- 1. a worker dies of SIGBUS or SIGSEGV -------------------------------------

SIGNALS = [
    pytest.param(signal.SIGBUS, ("SIGBUS", "shared memory", "--shm-size"), id="SIGBUS"),
    pytest.param(signal.SIGSEGV, ("SIGSEGV", "segmentation fault"), id="SIGSEGV"),
]


@pytest.mark.parametrize(("sig", "words"), SIGNALS)
def test_parallel_worker_killed_by_signal(shm_dir, sig, words):
    data = np.ones(500_000)  # 4 MB: dumped
    started = time.monotonic()
    with pytest.raises(memshare.WorkerDiedError) as info:
        Parallel(n_jobs=2)(delayed(die_if_shared)(data, sig) for _ in range(4))
    assert time.monotonic() - started < PROMPTLY
    message = str(info.value)
    for word in words:
        assert word in message, message
    assert memshare_entries(shm_dir) == []
    # The backend recovers: the next call gets fresh workers.
    assert Parallel(n_jobs=2)(delayed(total)(data) for _ in range(2)) == [500_000.0] * 2
    assert memshare_entries(shm_dir) == []


def _terminate_promptly(pool) -> None:
    stopper = threading.Thread(target=pool.terminate, daemon=True)
    stopper.start()
    stopper.join(PROMPTLY)
    assert not stopper.is_alive(), "terminate() hung after a worker died"


def _started_and_watched(pool, cue) -> bool:
    """True once a task started in ``cue`` and the pool's watch waits for the end of every worker that started one."""
    started = {int(name) for name in os.listdir(cue) if name.isdigit()}
    return bool(started) and started <= set(pool._watch.watched_pids())


@pytest.mark.parametrize(("sig", "words"), SIGNALS)
def test_pool_worker_killed_by_signal(shm_dir, tmp_path, sig, words):
    """A worker crashes in the middle of its task, which the pool's watch saw it start."""
    data = np.ones(500_000)
    pool = MemmappingPool(2)
    try:
        started = time.monotonic()
        result = pool.starmap_async(die_if_shared, [(data, sig, str(tmp_path))] * 4, chunksize=1)
        assert wait_until(lambda: _started_and_watched(pool, tmp_path), PROMPTLY), "no task started under watch"
        (tmp_path / "go").touch()
        with pytest.raises(memshare.WorkerDiedError) as info:
            result.get(timeout=PROMPTLY)
        assert time.monotonic() - started < PROMPTLY
        message = str(info.value)
        for word in words:
            assert word in message, message
        with pytest.raises(memshare.WorkerDiedError):
            pool.apply_async(total, (data,))  # the pool says it is broken
    finally:
        _terminate_promptly(pool)
    assert memshare_entries(shm_dir) == []


def first_or_die(x, i):
    """Return ``i``; task 99 crashes its worker at once."""
    if i == 99:
        return die_if_shared(x, signal.SIGSEGV)
    return i


@pytest.mark.parametrize("case", ["fresh-pool", "maxtasksperchild"])
def test_pool_worker_crashing_as_soon_as_it_starts(shm_dir, case):
    """A worker that dies as its first task starts: one of a new pool, or one replacing a retired worker.

    The pool's own thread drops an exited worker from its list at once, so a
    watch that only looked at that list could miss a worker that started and
    died in between.
    """
    data = np.ones(500_000)
    pool = MemmappingPool(1, maxtasksperchild=1) if case == "maxtasksperchild" else MemmappingPool(2)
    try:
        if case == "maxtasksperchild":
            assert wait_until(pool._watch.watched_pids, PROMPTLY), "the watch never waited on the first worker"
            assert pool.starmap(first_or_die, [(data, 1)]) == [1]  # retires it; a new worker starts
            result = pool.starmap_async(first_or_die, [(data, 2), (data, 99)], chunksize=1)
        else:
            result = pool.starmap_async(first_or_die, [(data, 99)])
        with pytest.raises(memshare.WorkerDiedError, match="SIGSEGV"):
            result.get(timeout=PROMPTLY)
    finally:
        _terminate_promptly(pool)
    assert memshare_entries(shm_dir) == []


# -- helpers for subprocess scenarios ------------------------------------------


def _start(code: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def _stop(child: subprocess.Popen) -> None:
    """Kill ``child`` (by pid) if it is still running, and reap it."""
    if child.poll() is None:
        child.kill()
    child.communicate(timeout=PROMPTLY)


def _assert_quiet(stderr: str) -> None:
    found = [word for word in NOISE if word in stderr]
    assert not found, f"stderr mentions {found}:\n{stderr}"


def _files_in(base) -> list:
    return files_under(base) if os.path.isdir(base) else []


def _entries_in(base) -> list:
    return memshare_entries(base) if os.path.isdir(base) else []


# -- 2. KeyboardInterrupt in the parent mid-call ------------------------------

# Both scripts raise KeyboardInterrupt on SIGINT even when started with SIGINT
# ignored (by nohup, or a shell's "&"), and mark each task as it starts.
INTERRUPTIBLE = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)

def slow(x):
    open(os.path.join(os.environ["STARTED_DIR"], str(os.getpid())), "w").close()
    time.sleep(60)
    return float(x[0])
"""

INTERRUPTED_PARALLEL = (
    INTERRUPTIBLE
    + """
import numpy as np
from memshare import Parallel, delayed

def double(i):
    return 2 * i

if __name__ == "__main__":
    data = np.ones(2_000_000)  # 16 MB: dumped
    try:
        Parallel(n_jobs=2)(delayed(slow)(data) for _ in range(4))
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    else:
        print("NOT INTERRUPTED", flush=True)
        sys.exit(3)
    assert Parallel(n_jobs=2)(delayed(double)(i) for i in range(8)) == [2 * i for i in range(8)]
    print("OK", flush=True)
"""
)

INTERRUPTED_POOL = (
    INTERRUPTIBLE
    + """
import numpy as np
from memshare import MemmappingPool

def double(i):
    return 2 * i

if __name__ == "__main__":
    data = np.ones(2_000_000)
    pool = MemmappingPool(2)
    try:
        pool.map(slow, [data] * 4, chunksize=1)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    else:
        print("NOT INTERRUPTED", flush=True)
        sys.exit(3)
    started = time.monotonic()
    pool.terminate()
    pool.join()
    print(f"TERMINATED in {time.monotonic() - started:.1f} s", flush=True)
    with MemmappingPool(2) as again:
        assert again.map(double, range(8)) == [2 * i for i in range(8)]
    print("OK", flush=True)
"""
)


@pytest.mark.parametrize("code", [INTERRUPTED_PARALLEL, INTERRUPTED_POOL], ids=["Parallel", "MemmappingPool"])
def test_keyboard_interrupt_mid_call(tmp_path, code):
    base = tmp_path / "interrupted"
    started = tmp_path / "started"
    started.mkdir()
    child = _start(code, {"MEMSHARE_TEMP_FOLDER": str(base), "STARTED_DIR": str(started)})
    try:
        assert wait_until(lambda: _files_in(base), 60), "the call never dumped its array"
        assert wait_until(lambda: len(os.listdir(started)) >= 2, 60), "the workers never started their tasks"
        child.send_signal(signal.SIGINT)
        try:
            stdout, stderr = child.communicate(timeout=PROMPTLY)
        except subprocess.TimeoutExpired:
            pytest.fail("the interrupted script hung")
    finally:
        _stop(child)
    assert child.returncode == 0, f"exit {child.returncode}\n{stdout}\n{stderr}"
    assert "INTERRUPTED" in stdout and "OK" in stdout, stdout
    _assert_quiet(stderr)
    assert wait_until(lambda: not _entries_in(base), 10), _entries_in(base)


# -- 3. stderr stays quiet ------------------------------------------------------

PRELUDE = """
import os, signal, sys, threading, time
import numpy as np
import memshare
from memshare import Parallel, delayed

def total(x):
    return float(x.sum())

def nested(x):
    halves = np.array_split(x, 2)
    return sum(Parallel(n_jobs=2)(delayed(total)(h) for h in halves))

def boom(x, i):
    if i == 3:
        raise ValueError("boom on purpose")
    return float(x[0])

def kill_me(x, i):
    if i == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    return float(x[0])

def twice(x):
    return x * 2  # a large result: comes back through a shared file

DATA = np.ones(1_000_000)  # 8 MB: dumped
"""

QUIET_SCENARIOS = {
    "plain": """
        assert Parallel(n_jobs=2)(delayed(total)(DATA) for _ in range(4)) == [1e6] * 4
    """,
    "nested": """
        assert Parallel(n_jobs=2)(delayed(nested)(DATA) for _ in range(4)) == [1e6] * 4
    """,
    "task_raises": """
        try:
            Parallel(n_jobs=2)(delayed(boom)(DATA, i) for i in range(8))
        except ValueError as exc:
            assert "boom on purpose" in str(exc)
        else:
            raise SystemExit("no error")
        assert Parallel(n_jobs=2)(delayed(total)(DATA) for _ in range(2)) == [1e6] * 2
    """,
    "no_dumping": """
        assert Parallel(n_jobs=2, max_nbytes=None)(delayed(total)(DATA) for _ in range(4)) == [1e6] * 4
        assert memshare.last_call_stats()["arrays_dumped"] == 0
    """,
    "killed_worker": """
        try:
            Parallel(n_jobs=2)(delayed(kill_me)(DATA, i) for i in range(4))
        except memshare.WorkerDiedError as exc:
            assert "SIGKILL" in str(exc)
        else:
            raise SystemExit("no WorkerDiedError")
        assert Parallel(n_jobs=2)(delayed(total)(DATA) for _ in range(2)) == [1e6] * 2
    """,
    "thirty_calls": """
        for i in range(30):
            out = Parallel(n_jobs=2)(delayed(twice)(DATA[: 200_000 + i]) for _ in range(3))
            assert [float(o.sum()) for o in out] == [2.0 * (200_000 + i)] * 3
    """,
    "two_threads": """
        errors, done = [], []
        def run(k):
            try:
                data = np.full(1_000_000, float(k))
                for _ in range(3):
                    assert Parallel(n_jobs=2)(delayed(total)(data) for _ in range(4)) == [1e6 * k] * 4
                done.append(k)
            except BaseException as exc:
                errors.append(repr(exc))
        threads = [threading.Thread(target=run, args=(k,)) for k in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and sorted(done) == [1, 2], (errors, done)
    """,
    "managed_context": """
        with Parallel(n_jobs=2) as parallel:
            for k in range(5):
                data = DATA * k
                assert parallel(delayed(total)(data) for _ in range(4)) == [1e6 * k] * 4
                assert parallel(delayed(twice)(DATA) for _ in range(2))[1][5] == 2.0
    """,
}


@pytest.mark.parametrize("name", sorted(QUIET_SCENARIOS))
def test_stderr_stays_quiet(tmp_path, name):
    base = tmp_path / "quiet"
    body = textwrap.indent(textwrap.dedent(QUIET_SCENARIOS[name]), "    ")
    code = f'{PRELUDE}\nif __name__ == "__main__":\n{body}\n    print("OK", flush=True)\n'
    child = _start(code, {"MEMSHARE_TEMP_FOLDER": str(base)})
    try:
        stdout, stderr = child.communicate(timeout=120)
    finally:
        _stop(child)
    assert child.returncode == 0 and stdout.strip().endswith("OK"), f"exit {child.returncode}\n{stdout}\n{stderr}"
    _assert_quiet(stderr)
    assert wait_until(lambda: not _entries_in(base), 10), _entries_in(base)


# -- 4. the tmpfs fills up from another thread ----------------------------------


class _Filler(threading.Thread):
    """Fills a folder's file system with 1 MB files, empties half of them, and again."""

    def __init__(self, folder) -> None:
        super().__init__(name="tmpfs-filler", daemon=True)
        self.folder = folder
        self.stop = threading.Event()
        self.times_full = 0
        self._files: list = []
        self._count = 0

    def run(self) -> None:
        chunk = b"\xff" * 1024**2
        while not self.stop.is_set():
            path = os.path.join(self.folder, f"filler-{self._count}")
            self._count += 1
            try:
                with open(path, "wb") as stream:
                    stream.write(chunk)
                self._files.append(path)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                self.times_full += 1
                _unlink(path)
                # Full: keep it so for a moment, then free half and fill again.
                self.stop.wait(0.02)
                for old in self._files[::2]:
                    _unlink(old)
                self._files = self._files[1::2]

    def remove_all(self) -> None:
        for path in self._files:
            _unlink(path)
        self._files = []


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _our_fallback_folders() -> list:
    """memshare folders of this process in the disk fallback location."""
    base = tempfile.gettempdir()
    return [entry for entry, _ in memshare_entries(base) if entry.startswith(f"memshare-{os.getpid()}-")]


@pytest.mark.version_independent
def test_tmpfs_filled_by_another_thread_never_kills_a_worker(small_tmpfs, monkeypatch):
    ours = small_tmpfs / "memshare"
    fillers = small_tmpfs / "filler"
    fillers.mkdir()
    monkeypatch.setenv("MEMSHARE_TEMP_FOLDER", str(ours))
    leftovers_before = set(_our_fallback_folders())
    filler = _Filler(str(fillers))
    outcomes = {"ok": 0, "full": 0}
    filler.start()
    try:
        for call in range(12):
            data = np.full(20 * 1024**2 // 8, float(call))  # 20 MB, fresh each call
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", memshare.SharedMemoryFallbackWarning)
                    out = Parallel(n_jobs=2)(delayed(total_and_result)(data, i) for i in range(3))
            except memshare.WorkerDiedError as exc:
                pytest.fail(f"call {call}: a worker died while the tmpfs filled up: {exc}")
            except OSError as exc:
                # memshare.SharedMemoryFullError is an OSError with ENOSPC.
                assert exc.errno == errno.ENOSPC, repr(exc)
                outcomes["full"] += 1
            else:
                assert [o[0] for o in out] == [float(call) * data.size] * 3
                assert [float(o[1][0]) for o in out] == [0.0, 1.0, 2.0]
                assert all(o[1].shape == (300_000,) for o in out)
                outcomes["ok"] += 1
                del out
            assert _entries_in(ours) == [], f"call {call} left files behind"
    finally:
        filler.stop.set()
        filler.join(PROMPTLY)
        filler.remove_all()
        shutil.rmtree(fillers, ignore_errors=True)
    assert not filler.is_alive()
    assert filler.times_full > 0, "the filler never filled the tmpfs: the race was not exercised"
    assert outcomes["ok"] + outcomes["full"] == 12
    assert set(_our_fallback_folders()) <= leftovers_before, "fallback folders left on disk"


# -- 5. the in-flight bound with the real backend --------------------------------


class _Sampler(threading.Thread):
    """Polls the bytes held in memshare folders under ``base``; keeps the peak."""

    def __init__(self, base) -> None:
        super().__init__(name="shm-sampler", daemon=True)
        self.base = str(base)
        self.stop = threading.Event()
        self.peak = 0
        self.samples = 0

    def _size(self) -> int:
        size = 0
        try:
            folders = [e.path for e in os.scandir(self.base) if e.name.startswith("memshare-")]
        except FileNotFoundError:
            return 0
        for folder in folders:
            try:
                for entry in os.scandir(folder):
                    try:
                        size += entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        pass
            except FileNotFoundError:
                pass
        return size

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self._size())
            self.samples += 1
            time.sleep(0.003)


N_TASKS = 400
ARRAY_BYTES = 2 * 1024**2


def _fresh_arrays():
    for i in range(N_TASKS):
        yield np.full(ARRAY_BYTES // 8, float(i))


@pytest.mark.version_independent
@pytest.mark.parametrize("keep_alive", [False, True], ids=["generator", "all-alive-in-a-list"])
def test_shared_memory_stays_bounded_over_many_distinct_arrays(shm_dir, keep_alive):
    """400 tasks, each with its own fresh 2 MB array: the folder holds about what is in flight.

    batch_size=1 pins what joblib keeps in flight (pre_dispatch = 4 tasks).
    With joblib's auto-batching and millisecond tasks, batches grow to 32-64
    tasks and up to ~128 arrays are legitimately in flight (256 MiB here), so
    a bound relative to the whole call would measure joblib, not memshare.
    """
    arrays = list(_fresh_arrays()) if keep_alive else None
    source = iter(arrays) if keep_alive else _fresh_arrays()
    sampler = _Sampler(shm_dir)
    sampler.start()
    try:
        out = Parallel(n_jobs=2, batch_size=1)(delayed(sleep_a_little)(a) for a in source)
    finally:
        sampler.stop.set()
        sampler.join(PROMPTLY)
    assert out == [float(i) for i in range(N_TASKS)]
    stats = memshare.last_call_stats()
    assert stats["arrays_dumped"] == N_TASKS, stats
    assert sampler.samples > 10 and sampler.peak > 0, "the sampler never saw a file"
    total_bytes = N_TASKS * ARRAY_BYTES
    message = f"peak {sampler.peak / 1024**2:.0f} MiB of {total_bytes / 1024**2:.0f} MiB"
    assert sampler.peak < total_bytes // 16, message  # measured: 8 MiB (generator), 14 MiB (list)
    assert memshare_entries(shm_dir) == []
