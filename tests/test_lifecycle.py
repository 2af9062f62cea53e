"""Lifecycle, crash safety, a small /dev/shm, security."""

import os
import subprocess
import sys
import warnings

import numpy as np
import psutil
import pytest
from conftest import alive, files_under, memshare_entries, run_script, total, wait_until

import memshare
from memshare import Parallel, SharedMemoryFullError, delayed
from memshare._config import Settings
from memshare._lifetime._folders import FolderPair
from memshare._lifetime._owners import Owner, new_folder_name
from memshare._lifetime._sweep import sweep_dead_owners
from memshare._parent._session import Session
from memshare._worker._run import run_task


def test_early_deletion_keeps_only_what_is_in_flight(shm_dir):
    """2,000 tasks each with its own array (scaled down): the folder stays small."""
    session = Session(Settings(max_nbytes=0))
    peak = 0
    arrays = [np.full(10_000, float(i)) for i in range(2000)]  # all alive, as in a list
    try:
        for array in arrays:
            ok, value = session.finish(run_task(session.pack_task(total, (array,))))
            assert ok and value == array[0] * 10_000
            peak = max(peak, len(files_under(shm_dir)))
    finally:
        session.close()
    assert peak <= 2


def test_shared_array_stays_until_the_call_ends(shm_dir):
    session = Session(Settings(max_nbytes=0))
    shared = np.ones(10_000)
    try:
        tasks = [session.pack_task(total, (shared,)) for _ in range(3)]
        for task in tasks:
            session.finish(run_task(task))
        assert len(files_under(shm_dir)) == 1
        session.finish(run_task(session.pack_task(total, (shared,))))
        assert session.stats.arrays_dumped == 1
    finally:
        session.close()
    assert memshare_entries(shm_dir) == []


def test_full_shm_falls_back_to_disk_with_one_warning(tmp_path, monkeypatch):
    primary, fallback = tmp_path / "full", tmp_path / "disk"
    pair = FolderPair(str(primary), str(fallback))
    real = os.posix_fallocate

    def no_room(fd, offset, length):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(primary)):
            raise OSError(28, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.warns(memshare.SharedMemoryFallbackWarning, match="shm-size"):
        path, fd = pair.create_file(1000, "dump")
        os.close(fd)
    assert path.startswith(str(fallback)) and os.listdir(primary) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        os.close(pair.create_file(1000, "dump")[1])  # once per call, not per array
    with pytest.raises(SharedMemoryFullError, match="no room for a"):
        FolderPair(str(primary), None).create_file(1000, "dump")
    assert os.listdir(primary) == []  # nothing partial left


@pytest.mark.version_independent
def test_small_tmpfs_falls_back_cleanly_and_no_worker_dies(small_tmpfs, monkeypatch):
    monkeypatch.setenv("MEMSHARE_TEMP_FOLDER", str(small_tmpfs))
    big = np.ones(200 * 1024**2 // 8)
    with pytest.warns(memshare.SharedMemoryFallbackWarning):
        assert Parallel(n_jobs=2)(delayed(total)(big) for _ in range(2)) == [float(big.size)] * 2
    assert memshare.last_call_stats()["fallback_files"] == 1
    assert memshare_entries(small_tmpfs) == []


@pytest.mark.version_independent
def test_small_tmpfs_results_fall_back_too(small_tmpfs, monkeypatch):
    monkeypatch.setenv("MEMSHARE_TEMP_FOLDER", str(small_tmpfs))
    # The worker's fallback is reported in the parent, where the caller's warning filters apply.
    with pytest.warns(memshare.SharedMemoryFallbackWarning, match="100.0 MiB array .* on disk instead"):
        (result,) = Parallel(n_jobs=2)(delayed(np.ones)(100 * 1024**2 // 8) for _ in range(1))
    assert result.sum() == 100 * 1024**2 // 8
    assert memshare.last_call_stats()["fallback_files"] == 1


def test_parent_sigkilled_mid_call_leaves_nothing(tmp_path):
    base = tmp_path / "killed"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            """
import time, numpy as np
from memshare import Parallel, delayed
def slow(x):
    time.sleep(30)
if __name__ == "__main__":
    data = np.ones(300_000)
    Parallel(n_jobs=2)(delayed(slow)(data) for _ in range(2))
""",
        ],
        env={**os.environ, "MEMSHARE_TEMP_FOLDER": str(base)},
    )
    try:
        assert wait_until(lambda: files_under(base), 60, interval=0.1), "the call never dumped its array"

        def descendant_pids():
            return [p.pid for p in psutil.Process(child.pid).children(recursive=True)]

        # The array is dumped before loky starts the workers: wait for them
        # (two workers and the watchdog, at least).
        assert wait_until(lambda: len(descendant_pids()) >= 3, 60, interval=0.1), descendant_pids()
        descendants = descendant_pids()
        child.kill()
        child.wait()
        wait_until(lambda: not memshare_entries(base) and not any(alive(p) for p in descendants), 10, interval=0.1)
        assert memshare_entries(base) == []
        survivors = [(p, open(f"/proc/{p}/cmdline").read()[:80]) for p in descendants if alive(p)]
        assert not survivors, f"processes of the dead parent are still running: {survivors}"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_sweep_never_deletes_a_live_owner_and_survives_pid_reuse(tmp_path):
    me = Owner.current()
    live = tmp_path / new_folder_name(me)
    reused = tmp_path / new_folder_name(Owner(me.pid, me.start + 1, me.namespace, me.host))  # same pid, other start
    other_ns = tmp_path / new_folder_name(Owner(999_999, 1, me.namespace + 1, me.host))
    for folder in (live, reused, other_ns):
        folder.mkdir()
        (folder / "dump-x.bin").write_bytes(b"x" * 4096)
    removed = [path for path, _ in sweep_dead_owners({str(tmp_path)})]
    assert removed == [str(reused)]
    assert live.exists() and other_ns.exists() and not reused.exists()


def test_planted_symlinks_are_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    folder = tmp_path / "memshare-folder"
    folder.symlink_to(tmp_path)  # a planted symlink where a folder would go
    with pytest.raises(PermissionError):
        FolderPair(str(folder)).create_file(10, "dump")
    assert victim.read_text() == "keep me"


def test_a_worker_refuses_references_outside_memshare_folders(tmp_path):
    from memshare._transport._mapping import array_from_ref
    from memshare._transport._refs import DUMP, ArrayRef

    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\1" * 64)
    info = os.stat(secret)
    forged = ArrayRef(str(secret), info.st_dev, info.st_ino, DUMP, "r", 0, (8,), (8,), np.dtype("f8"))
    with pytest.raises(PermissionError, match="refusing"):
        array_from_ref(forged)


@pytest.mark.parametrize("name", ["dossier-é-ünïcode", "x" * 200])
def test_non_ascii_and_long_temp_paths(tmp_path, name):
    base = tmp_path / name
    data = np.ones(300_000)
    result = run_script(
        f"""
        import warnings
        import numpy as np
        from memshare import Parallel, delayed
        warnings.filterwarnings("ignore", message=".*is on .*, not RAM")  # the folder is on disk on purpose
        def f(x):
            return float(x.sum())
        if __name__ == "__main__":
            print(Parallel(n_jobs=2, temp_folder={str(base)!r})(delayed(f)(np.ones(300_000)) for _ in range(2)))
        """
    )
    assert "300000.0" in result.stdout and result.stderr.strip() == ""
    assert memshare_entries(base) == []
    del data


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pool_parent_sigkilled_leaves_nothing_and_workers_exit(tmp_path, method):
    base = tmp_path / "killed-pool"
    pids_file = tmp_path / "pids"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import os, time, multiprocessing as mp, numpy as np
from memshare import MemmappingPool
def slow(x):
    time.sleep(60)
def pid(_):
    time.sleep(0.2)
    return os.getpid()
if __name__ == "__main__":
    pool = MemmappingPool(2, context=mp.get_context({method!r}))
    pids = set(pool.map(pid, range(4), chunksize=1))
    open({str(pids_file)!r}, "w").write(" ".join(map(str, pids)))
    pool.map(slow, [np.ones(300_000)] * 2)
""",
        ],
        env={**os.environ, "MEMSHARE_TEMP_FOLDER": str(base)},
    )
    try:
        wait_until(lambda: files_under(base), 60, interval=0.1)
        assert files_under(base), "the pool never dumped its array"
        workers = [int(p) for p in pids_file.read_text().split()]
        child.kill()
        child.wait()
        wait_until(lambda: not memshare_entries(base) and not any(alive(p) for p in workers), 10, interval=0.1)
        assert memshare_entries(base) == []
        assert not any(alive(p) for p in workers), "orphaned workers did not exit"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def mapped_memshare_files(_=None):
    with open("/proc/self/maps") as maps:
        return sorted({line.split(None, 5)[5].strip() for line in maps if "/memshare-" in line})


def _command_line(process) -> str:
    """The process's command line; empty for one that exited (or is a zombie, as killed workers of earlier tests)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def test_idle_workers_let_go_of_deleted_dumps_promptly(shm_dir):
    data = np.ones(300_000)
    first = Parallel(n_jobs=2)(delayed(mapped_memshare_files)(data) for _ in range(4))
    assert any(first), "workers should have mapped the dump during the call"
    workers = {p.pid for p in psutil.Process().children(recursive=True) if "loky" in _command_line(p)}
    assert workers

    def leftovers():
        found = []
        for pid in workers:
            try:
                with open(f"/proc/{pid}/maps") as maps:
                    found += [line for line in maps if "/memshare-" in line and "dump-" in line]
            except FileNotFoundError:
                pass
        return found

    # The pruner checks every 50 ms while it holds mappings.
    assert wait_until(lambda: not leftovers(), 10), leftovers()
