"""Breadth: thousands of arrays without running out of descriptors, and nothing left behind.

A mapping needs no descriptor once it exists, so memshare keeps none for
its mappings (``_mapping.map_file``), holds its memfds to a budget of the
descriptor limit (``_memfd.budget``), and bounds its cache of mappings by
count. These tests run the user's case under a hard limit of 1024
descriptors, in a fresh interpreter each (the limit is per process and
inherited by the workers).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import process_tree, run_script, wait_until, without_location_settings

from memshare._lifetime._owners import Owner, new_folder_name
from memshare._lifetime._sweep import sweep_dead_owners
from memshare._lifetime._watchdog import loky_semaphores
from memshare._transport._backing import find_backing
from memshare._transport._mapping import MappingCache, array_from_ref, map_file

# Version-independent (thousands of arrays, descriptor limits and caches: a soak of memshare's own bookkeeping): run
# in CI's whole-suite environment (main) only.
pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="descriptor limits and /proc: Linux"),
    pytest.mark.version_independent,
]

#: A user's case: 3000 arrays of 128 KiB, 375 per task, under ``ulimit -n`` 1024 (soft and hard).
BREADTH_SCRIPT = """
import json, os, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))  # soft and hard: nothing to raise
import numpy as np
import memshare
from memshare import MemmappingPool, Parallel, delayed
from memshare._lifetime import _memfd, _memfd_census


def sums(arrays):
    return [float(a.sum()) for a in arrays]


def held_in_worker(_):
    return os.getpid(), _memfd_census.descriptors_of()


def main():
    arrays = [np.full(16384, float(i)) for i in range(3000)]
    expected = [16384.0 * i for i in range(3000)]
    lists = [arrays[i::8] for i in range(8)]
    wanted = [expected[i::8] for i in range(8)]
    for _ in range(2):
        assert Parallel(n_jobs=2, max_nbytes="64K")(delayed(sums)(part) for part in lists) == wanted
    with MemmappingPool(2, max_nbytes="64K") as pool:
        assert pool.map(sums, lists) == wanted
        workers = dict(pool.map(held_in_worker, range(8), chunksize=1))
    assert Parallel(n_jobs=2, max_nbytes="64K")(delayed(sums)(part) for part in [arrays]) == [expected]
    with Parallel(n_jobs=2, max_nbytes="64K") as parallel:
        assert parallel(delayed(sums)(part) for part in lists) == wanted
        workers.update(parallel(delayed(held_in_worker)(i) for i in range(8)))
        parent = _memfd_census.descriptors_of()
    files = [open(os.devnull) for _ in range(300)]  # the program's own files, arrays still alive
    assert len(files) == 300 and float(arrays[-1][0]) == 2999.0
    print(json.dumps({"parent": parent, "workers": workers, "budget": _memfd.budget()}))


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize(
    "env",
    [{}, {"MEMSHARE_MEMFD": "0"}, {"MEMSHARE_PROMOTE": "0"}],
    ids=["default", "memfd-off", "hold-once-off"],
)
def test_thousands_of_arrays_under_a_hard_limit_of_1024_descriptors(tmp_path, env):
    script = tmp_path / "breadth.py"
    script.write_text(BREADTH_SCRIPT)
    full_env = {**without_location_settings(), **env}  # memshare's own choice, as for a user
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=full_env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    held = json.loads(result.stdout.strip().splitlines()[-1])
    # Reported (pytest -s shows it): what memshare holds after the calls, arrays alive.
    print(f"descriptors memshare holds: parent {held['parent']}, workers {held['workers']} (budget {held['budget']})")
    assert held["budget"] == 512
    assert held["parent"] <= held["budget"]
    assert held["workers"] and all(count <= held["budget"] for count in held["workers"].values())
    # The workers keep no descriptor for the thousands of arrays they mapped.
    assert all(count < 16 for count in held["workers"].values()), held


def _user_memmap(path, shape=(1000,), offset=0):
    data = np.memmap(path, dtype=np.float64, mode="w+", shape=shape, offset=offset)
    data[:] = np.arange(shape[0])
    data.flush()
    return data


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_arrays_rebuilt_from_references_are_memmaps_that_keep_no_descriptor(tmp_path):
    path = tmp_path / "user.bin"
    _user_memmap(path, offset=4096 + 24)
    opened = np.memmap(path, dtype=np.float64, mode="r", shape=(1000,), offset=4096 + 24)
    ref = find_backing(opened[10:20])
    before = _open_descriptors()
    rebuilt = [array_from_ref(ref, cached=False) for _ in range(200)]
    assert _open_descriptors() - before < 5  # np.memmap would keep 200
    for x in rebuilt[:3]:
        assert isinstance(x, np.memmap)
        assert os.fspath(x.filename) == str(path) and x.offset == 4096 + 24 and x.mode == "r"
        assert not x.flags.writeable
        np.testing.assert_array_equal(x, np.arange(10, 20))
        part = x[2:5]
        assert isinstance(part, np.memmap) and os.fspath(part.filename) == str(path) and part.offset == 4096 + 24
        # Still found as a view of the file: a returned view of an input goes back by reference.
        again = find_backing(part)
        assert again is not None and again.offset == 4096 + 24 + 12 * 8 and again.is_file(os.stat(path))
        plain = np.asarray(x)
        assert type(plain) is np.ndarray and find_backing(plain).offset == ref.offset


def test_a_read_only_rebuilt_array_cannot_be_made_writable(tmp_path):
    path = tmp_path / "user.bin"
    _user_memmap(path)
    ref = find_backing(np.memmap(path, dtype=np.float64, mode="r", shape=(1000,)))
    x = array_from_ref(ref, cached=False)
    with pytest.raises(ValueError):
        x.flags.writeable = True  # the pages are mapped read-only: a write would crash the process


def test_a_writable_rebuilt_array_writes_the_file_and_copy_on_write_stays_private(tmp_path):
    path = tmp_path / "user.bin"
    original = _user_memmap(path)
    ref = find_backing(original)
    for mode, seen in (("r+", 7.0), ("c", 0.0)):
        x = array_from_ref(_with_mode(ref, mode), cached=False)
        # .mode is the user's memmap's ('w+' reported as 'r+'), as numpy gives any slice of it.
        assert isinstance(x, np.memmap) and x.mode == "r+" and x.flags.writeable
        x[0] = 7.0
        assert original[0] == seen
        original[0] = 0.0
    assert find_backing(array_from_ref(_with_mode(ref, "c"), False)) is None  # private pages go by value


def _with_mode(ref, mode):
    return dataclasses.replace(ref, mode=mode)


def test_an_empty_file_is_refused_as_numpy_does(tmp_path):
    path = tmp_path / "user.bin"
    _user_memmap(path)
    ref = find_backing(np.memmap(path, dtype=np.float64, mode="r", shape=(1000,)))
    os.truncate(path, 0)
    with pytest.raises(ValueError, match="empty"):
        map_file(ref)


def test_the_cache_of_mappings_is_bounded_least_recently_used_first(tmp_path):
    cache = MappingCache(limit=100)
    refs = []
    for i in range(20000):  # tens of thousands of arrays over many tasks
        path = tmp_path / f"f{i}.bin"
        with open(path, "wb") as handle:
            handle.write(np.full(4, float(i)).tobytes())
        data = np.memmap(path, dtype=np.float64, mode="r", shape=(4,))
        refs.append(find_backing(data))
        del data
    first = cache.array(refs[0])
    maps_before = len(open("/proc/self/maps").read().splitlines())
    for i, ref in enumerate(refs[1:], 1):
        assert float(cache.array(ref)[0]) == float(i)
        if i % 50 == 0:
            cache.array(refs[1])  # used again and again: stays in
    assert len(cache) == 100
    maps_after = len(open("/proc/self/maps").read().splitlines())
    assert maps_after - maps_before < 150  # not 20000
    # Forgotten by the cache, still mapped for the array alive over it.
    assert float(first[0]) == 0.0 and find_backing(first).is_file(os.stat(tmp_path / "f0.bin"))
    kept = cache.array(refs[1])
    assert np.shares_memory(kept, cache.array(refs[1]))  # a hit: the same mapping
    assert len(cache) == 100


def test_a_deleted_file_leaves_the_cache_without_any_descriptor(tmp_path):
    path = tmp_path / "user.bin"
    _user_memmap(path)
    ref = find_backing(np.memmap(path, dtype=np.float64, mode="r", shape=(1000,)))
    cache = MappingCache()
    cache.array(ref)
    cache.prune()
    assert len(cache) == 1
    os.unlink(path)
    cache.prune()
    assert len(cache) == 0


BUDGET_SCRIPT = """
import logging, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 1024))
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
import memshare
from memshare._lifetime import _memfd

arrays = [memshare.zeros(1024) for _ in range(700)]
print("held", _memfd.held_count(), "budget", _memfd.budget(), "soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
named = sum(1 for a in arrays if not _memfd.is_memfd_path(memshare._transport._backing.find_backing(a).path))
print("named", named)
"""


def test_the_budget_raises_the_soft_limit_once_then_uses_named_files():
    result = run_script(BUDGET_SCRIPT, env={"MEMSHARE_TEMP_FOLDER": "", "MEMSHARE_MEMFD": "1"})
    out = result.stdout
    if "named files (memfds unusable)" in out:
        pytest.skip("memfds do not work here")
    assert out.count("raised the soft descriptor limit (ulimit -n) from 256 to 1024") == 1, out
    assert out.count("new shared memory is named files in the private folder") == 1, out
    assert "held 496 budget 512 soft 1024" in out, out  # 16 left to sockets and their folders
    assert "named 204" in out, out


def test_doctor_reports_the_descriptor_limits_and_what_memshare_holds():
    out = subprocess.run(
        [sys.executable, "-m", "memshare", "doctor"], capture_output=True, text=True, timeout=120
    ).stdout
    assert "descriptor limit (ulimit -n): soft" in out
    assert "memshare holds" in out and "descriptor(s) in this process" in out


KILLED_RUN = """
import os, sys, time
import numpy as np
from memshare import Parallel, delayed

def pid_of_worker(x):
    return os.getpid()

if __name__ == "__main__":
    with Parallel(n_jobs=2, max_nbytes="1K") as parallel:
        parallel(delayed(pid_of_worker)(np.ones(1000)) for _ in range(4))
        print("ready", flush=True)
        time.sleep(600)
"""


def _named_after(pids) -> list:
    names = os.listdir("/dev/shm")
    return sorted(n for n in names for p in pids if n.startswith(f"sem.loky-{p}-") or n.startswith(f"memshare-{p}-"))


def _start_and_kill(tmp_path, spare_watchdog: bool):
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED_RUN))
    env = without_location_settings()
    process = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        assert process.stdout.readline().strip() == "ready"
        everyone = process_tree(process.pid)
        assert any(n.startswith(f"sem.loky-{process.pid}-") for n in os.listdir("/dev/shm"))
        watchdogs = [p for p in everyone if b"_watchdog.py" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert watchdogs, "the run has a watchdog"
        # The watchdogs first (when they die too), so that they cannot clean up: then only
        # `memshare clean` can; the owner next, then the rest.
        order = ([] if spare_watchdog else watchdogs) + [p for p in everyone if p not in watchdogs]
        for pid in order:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
    return everyone, watchdogs


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_killing_every_process_then_clean_leaves_nothing_named_after_them(tmp_path):
    everyone, _ = _start_and_kill(tmp_path, spare_watchdog=False)
    wait_until(lambda: all(not os.path.exists(f"/proc/{p}") for p in everyone), timeout=10)
    # Whatever is left (another process's first folder may already have swept a dead owner):
    subprocess.run([sys.executable, "-m", "memshare", "clean"], capture_output=True, timeout=120, check=True)
    assert _named_after(everyone) == []


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_the_watchdog_removes_a_killed_owners_semaphores(tmp_path):
    everyone, watchdogs = _start_and_kill(tmp_path, spare_watchdog=True)
    assert wait_until(lambda: _named_after(everyone) == [], timeout=15), _named_after(everyone)
    assert wait_until(lambda: all(not os.path.exists(f"/proc/{p}") for p in watchdogs), timeout=15)


def test_semaphores_of_a_live_process_are_never_removed():
    from memshare._lifetime._watchdog import remove_loky_semaphores

    assert remove_loky_semaphores(os.getpid()) == []
    assert all(os.path.basename(p).startswith("sem.loky-") for p in loky_semaphores())


def _fake_semaphore(pid: int) -> str:
    """A file named as loky names a semaphore of ``pid`` (what glibc's sem_open makes)."""
    letters = "abcdefghijklmnopqrstuvwxyz0123456789_"
    path = f"/dev/shm/sem.loky-{pid}-" + "".join(secrets.choice(letters) for _ in range(8))
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    return path


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_the_sweep_removes_a_dead_owners_semaphores_only(tmp_path):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(finished.stdout)
    me = Owner.current()
    base = tmp_path / "base"
    base.mkdir()
    os.mkdir(base / new_folder_name(Owner(dead, 12345, me.namespace, me.host)))
    # A folder named after this (live) process with another start time: its owner is dead,
    # but the pid now runs this process, whose semaphores must stay.
    os.mkdir(base / new_folder_name(Owner(me.pid, me.start + 1, me.namespace, me.host)))
    dead_sem, live_sem = _fake_semaphore(dead), _fake_semaphore(me.pid)
    try:
        removed = [path for path, _ in sweep_dead_owners({str(base)})]
        assert dead_sem in removed and not os.path.exists(dead_sem)
        assert live_sem not in removed and os.path.exists(live_sem)
        assert os.listdir(base) == []
    finally:
        for path in (dead_sem, live_sem):
            if os.path.exists(path):
                os.unlink(path)
