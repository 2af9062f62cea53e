"""Nameless shared memory (memfd): the default on Linux, its fallback, crashes and small or read-only mounts."""

import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from typing import Optional

import numpy as np
import pytest
from conftest import (
    memfds_held,
    memshare_entries,
    process_tree,
    run_script,
    run_with_private_mounts,
    wait_until,
    without_location_settings,
)

import memshare
from memshare import Parallel, delayed
from memshare._config import Settings
from memshare._lifetime import _memfd, _memfd_census
from memshare._lifetime._folders import FolderPair, delete_file
from memshare._lifetime._location import choose_location
from memshare._lifetime._owners import parse_folder_name
from memshare._lifetime._watchdog import remove_loky_semaphores
from memshare._parent._session import Session
from memshare._transport import _handoff
from memshare._transport._handoff import Inbox
from memshare._transport._mapping import MappingCache, map_file
from memshare._transport._refs import DUMP, SHARED, ArrayRef
from memshare._worker._run import run_task

MIB = 1024**2

pytestmark = pytest.mark.skipif(
    not _memfd.decision().in_memory, reason=f"memfds are not usable here: {_memfd.decision().reason}"
)


def where_is(X):
    return X.filename, float(X.sum())


def fill_row(out, i):
    out[i] = i


def test_dumps_and_shared_arrays_are_memfds_held_by_the_parent(default_location, monkeypatch):
    monkeypatch.setenv("MEMSHARE_PROMOTE", "0")  # a dump, not an array held once (tests/test_held_once.py)
    gc.collect()
    before = len(memfds_held())
    X = np.arange(1_000_000, dtype=np.float64)
    paths = Parallel(n_jobs=2, max_nbytes="1K")(delayed(where_is)(X) for _ in range(2))
    assert {path for path, _ in paths} == {paths[0][0]}
    assert paths[0][0].startswith(f"/proc/{os.getpid()}/fd/") and paths[0][1] == X.sum()
    assert memshare.last_call_stats()["arrays_dumped"] == 1
    assert len(memfds_held()) == before  # the call closed its dump

    out = memshare.zeros((8, 1000))
    assert memshare.is_shared(out)
    assert [t for t in memfds_held() if t.startswith("/memfd:memshare-shared-")]
    Parallel(n_jobs=2)(delayed(fill_row)(out, i) for i in range(8))
    assert out[:, 0].tolist() == list(range(8))
    del out
    gc.collect()
    assert len(memfds_held()) == before


def test_explicit_temp_folder_keeps_named_files(shm_dir):
    assert not choose_location().in_memory
    X = np.arange(1_000_000, dtype=np.float64)
    path, total = Parallel(n_jobs=2, max_nbytes="1K")(delayed(where_is)(X) for _ in range(1))[0]
    assert path.startswith(str(shm_dir)) and total == X.sum()
    assert not choose_location(str(shm_dir)).in_memory


def test_no_working_probe_means_named_files_and_the_log_says_why(tmp_path):
    script = """
        import numpy as np
        from memshare import Parallel, delayed
        from memshare._lifetime import _memfd
        {patch}
        def where(X):
            return X.filename
        X = np.ones(100_000)
        print("PATH", Parallel(n_jobs=2, max_nbytes="1K")(delayed(where)(X) for _ in range(1))[0])
    """
    switched = run_script(script.format(patch=""), env={"MEMSHARE_MEMFD": "0", "MEMSHARE_DEBUG": "1"})
    assert "PATH /dev/shm/memshare-" in switched.stdout or f"PATH {tempfile.gettempdir()}" in switched.stdout
    assert "shared memory is named files (memfds unusable): MEMSHARE_MEMFD=0 turns memfds off" in switched.stderr
    # The probe's other process cannot open the memfd: named files, and the log quotes its error.
    refused = run_script(
        script.format(patch="_memfd._PROBE_CHILD = 'import sys; sys.exit(\"open: Permission denied\")'"),
        env={"MEMSHARE_DEBUG": "1"},
    )
    assert "PATH /proc/" not in refused.stdout
    assert "another process could not open a memfd through /proc/" in refused.stderr
    assert "open: Permission denied" in refused.stderr


def test_pair_creates_and_deletes_memfds_for_any_caller():
    """One create/delete pair for both mechanisms: what a dump uses, anything else can use."""
    pair = FolderPair("/nonexistent/memshare-never-made", None, in_memory=True)
    path, fd = pair.create_file(3 * 4096, "dump")
    try:
        assert path == f"/proc/{os.getpid()}/fd/{_memfd_number(path)}" and path in _memfd.held_paths()
        assert os.fstat(fd).st_size == 3 * 4096 and os.fstat(fd).st_mode & 0o777 == 0o600
        os.write(fd, b"\x01" * 4096)
    finally:
        os.close(fd)
    mapped = np.memmap(path, mode="r", dtype=np.uint8)  # the caller's own descriptor is closed: the file lives
    assert mapped[:4096].sum() == 4096 and mapped[4096:].sum() == 0
    delete_file(path)
    assert path not in _memfd.held_paths() and not os.path.exists(path)
    assert mapped[0] == 1  # a mapping keeps the memory, as with an unlinked file
    delete_file(path)  # twice is no error


def _memfd_number(path):
    return int(path.rsplit("/", 1)[1])


def _dump_ref(path, fd, nbytes):
    info = os.fstat(fd)
    return ArrayRef(path, info.st_dev, info.st_ino, DUMP, "r", 0, (nbytes,), (1,), np.dtype(np.uint8))


def test_worker_cache_drops_closed_and_reused_memfds():
    pair = FolderPair("/nonexistent/memshare-never-made", None, in_memory=True)
    cache = MappingCache()
    path, fd = pair.create_file(4096, "dump")
    ref = _dump_ref(path, fd, 4096)
    os.close(fd)
    assert cache.array(ref).sum() == 0
    delete_file(path)  # the owner closes it: the path no longer stats
    cache.prune()
    assert cache._bases == {}

    path, fd = pair.create_file(4096, "dump")
    ref = _dump_ref(path, fd, 4096)
    os.close(fd)
    cache.array(ref)
    delete_file(path)
    reused, fd = pair.create_file(4096, "dump")  # the lowest free number: most likely the same
    os.close(fd)
    try:
        assert os.path.exists(path) == (reused == path)
        cache.prune()  # same path or none at all: either way another inode
        assert cache._bases == {}
    finally:
        delete_file(reused)


def test_a_proc_path_must_name_a_memshare_memfd_of_its_kind(tmp_path):
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"\0" * 4096)
    fd = os.open(plain, os.O_RDONLY)
    try:
        with pytest.raises(PermissionError, match="not a memshare dump"):
            map_file(_dump_ref(f"/proc/{os.getpid()}/fd/{fd}", fd, 4096))
    finally:
        os.close(fd)
    pair = FolderPair("/nonexistent/memshare-never-made", None, in_memory=True)
    path, fd = pair.create_file(4096, "shared")
    try:
        with pytest.raises(PermissionError, match="not a memshare dump"):
            map_file(_dump_ref(path, fd, 4096))
        info = os.fstat(fd)
        shared = ArrayRef(path, info.st_dev, info.st_ino, SHARED, "r", 0, (4096,), (1,), np.dtype(np.uint8))
        assert map_file(shared).sum() == 0
    finally:
        os.close(fd)
        delete_file(path)


def test_a_forked_child_closes_the_memfds_it_inherited():
    result = run_script(
        """
        import os, sys
        sys.path.insert(0, os.environ["TESTS_DIR"])
        from conftest import memfds_held
        import memshare
        from memshare._lifetime import _memfd
        a = memshare.zeros(1000)
        kept = _memfd.held_paths()[0].replace(f"/proc/{os.getpid()}/", "/proc/self/")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                # The mapping keeps no descriptor (_mapping.map_file): none is left in the child.
                ok = not _memfd.held_paths() and not os.path.exists(kept) and len(memfds_held()) == 0
                a[0] = 7  # the mapping itself is inherited and shared
                os.write(w, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        print("CHILD", os.read(r, 1).decode(), "PARENT", len(_memfd.held_paths()), a[0])
        """,
        timeout=60,
        env={"TESTS_DIR": os.path.dirname(__file__)},
    )
    assert "CHILD 1 PARENT 1 7.0" in result.stdout


def _shmem_bytes():
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


KILLED_RUN = """
    import os, sys, time
    import numpy as np
    from memshare import Parallel, delayed

    def wait_mid_call(X, flags):
        open(os.path.join(flags, str(os.getpid())), "w").close()
        time.sleep(600)

    X = np.ones(512 * 2**20 // 8)
    Parallel(n_jobs=2)(delayed(wait_mid_call)(X, sys.argv[1]) for _ in range(2))
"""


@pytest.mark.version_independent
def test_every_process_of_a_run_killed_at_once_leaves_nothing(tmp_path, default_location):
    flags = tmp_path / "flags"
    flags.mkdir()
    run = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_RUN), str(flags)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert wait_until(lambda: len(os.listdir(flags)) == 2 or run.poll() is not None, 120), "workers never started"
        assert run.poll() is None, run.stderr.read().decode()
        held = [m for m in _memfd_census.live_memfds() if m.pid == run.pid]
        # The parent holds X's memory as a memfd: X is held once (its head page makes the file one page longer).
        assert [(m.kind, m.nbytes) for m in held] == [("held", 512 * MIB + 4096)]
        processes = process_tree(run.pid)
        assert len(processes) >= 3  # the parent and its two workers at least
        before_kill = _shmem_bytes()
    finally:
        for pid in process_tree(run.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        run.wait()
        run.stderr.close()
    # The machine's other processes may change Shmem meanwhile: the 512 MiB must go, give or take 112 MiB.
    assert wait_until(lambda: _shmem_bytes() <= before_kill - 400 * MIB, 2.0), (before_kill, _shmem_bytes())
    assert not [m for m in _memfd_census.live_memfds() if m.pid in processes]
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in processes), 10)
    for base in ("/dev/shm", tempfile.gettempdir()):
        # Names parsed as ``memshare clean`` parses them: other memshare-* entries (a clone, a venv) are not ours.
        left = [(name, files) for name, files in memshare_entries(base) if _owner_pid(name) in processes]
        # A memfd session's folder holds only its result inbox's socket (no memory, no data): with the
        # watchdog killed too, the next run's sweep of dead owners removes it. Nothing else may be left.
        assert [entry for entry in left if any(not f.startswith("inbox-") for f in entry[1] or [])] == []
        for name, _ in left:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    # loky's named semaphores of the killed run stay too (nothing of theirs is left to unlink them): as the
    # sweep and `memshare clean` would, remove them, so that the test leaves nothing behind.
    for pid in processes:
        remove_loky_semaphores(pid)


def _owner_pid(name: str) -> Optional[int]:
    owner = parse_folder_name(name)
    return None if owner is None else owner.pid


SMALL_MOUNTS_RUN = """
    import os, tempfile, warnings
    import numpy as np
    import memshare
    from memshare import Parallel, delayed

    def chunk_sum(X, i):
        return float(X[i].sum())

    def result(i):
        return np.full(128 * 2**20 // 8, float(i))

    X = np.ones((64, 512 * 2**20 // 8 // 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # joblib 1.3 on Python 3.12 uses the deprecated ast.Num: not memshare's warning.
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="joblib")
        sums = Parallel(n_jobs=2)(delayed(chunk_sum)(X, i) for i in range(64))
        stats = memshare.last_call_stats()
        results = Parallel(n_jobs=2)(delayed(result)(i) for i in range(4))
        back = memshare.last_call_stats()
    assert sums == [float(X.shape[1])] * 64, sums
    assert [float(r[-1]) for r in results] == [0.0, 1.0, 2.0, 3.0]
    sent = stats["arrays_dumped"] + stats["arrays_held_once"]
    sent_bytes = stats["bytes_dumped"] + stats["bytes_held_once"]
    print("SENT", sent, sent_bytes // 2**20, "FALLBACK", stats["fallback_files"])
    print("RESULTS", back["results_by_reference"], back["bytes_results_by_reference"] // 2**20,
          "FALLBACK", back["fallback_files"], "PICKLED", back["results_pickled_no_room"])
    print("LEFT", sorted(os.listdir("/dev/shm")), sorted(os.listdir(tempfile.gettempdir())))
"""


@pytest.mark.version_independent
@pytest.mark.parametrize("promote", ["1", "0"], ids=["held-once", "dumped"])
def test_a_64_mb_shm_and_temp_dir_change_nothing(promote, tmp_path):
    temp = _temp_dir(tmp_path)
    result = run_with_private_mounts(
        SMALL_MOUNTS_RUN,
        {"/dev/shm": "size=64m", temp: "size=64m"},
        extra_env={"MEMSHARE_PROMOTE": promote, "TMPDIR": temp},
    )
    assert result.returncode == 0, result.stderr
    assert "SENT 1 512 FALLBACK 0" in result.stdout
    assert "RESULTS 4 512 FALLBACK 0 PICKLED 0" in result.stdout
    assert "LEFT [] []" in result.stdout or _only_loky_semaphores(result.stdout)
    assert "Warning" not in result.stderr


def _temp_dir(tmp_path) -> str:
    """A folder to mount the small temp dir on, and to point TMPDIR at.

    Not /tmp itself: a checkout or virtual environment under /tmp (CI may
    clone there) would vanish under the mount, and the interpreter with it.
    """
    folder = tmp_path / "tmp"
    folder.mkdir()
    return str(folder)


def _only_loky_semaphores(stdout):
    line = next(line for line in stdout.splitlines() if line.startswith("LEFT"))
    return "memshare" not in line


READ_ONLY_RUN = """
    import ctypes, os, tempfile
    import numpy as np
    import memshare
    from memshare import MemmappingPool, Parallel, delayed

    def chunk_sum(X, i):
        return float(X[i].sum()), X.filename, np.full(2**20, float(i)), memshare.full(2**20, float(i))

    def read_only(path):
        # Over the writable mounts: the workers and their semaphores, which need a
        # writable /dev/shm (multiprocessing's, not memshare's), exist already.
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mount(b"tmpfs", path.encode(), b"tmpfs", 1, b"size=1m") != 0:
            raise OSError(ctypes.get_errno(), "mount")

    X = np.ones((8, 2**20))
    Parallel(n_jobs=2)(delayed(chunk_sum)(X, 0) for _ in range(2))
    with MemmappingPool(2) as pool:
        pool.starmap(chunk_sum, [(X, 0)])
        read_only("/dev/shm"); read_only(tempfile.gettempdir())
        for path in ("/dev/shm/x", os.path.join(tempfile.gettempdir(), "x")):
            try:
                open(path, "w")
            except OSError as exc:
                print("READ-ONLY", path, exc.errno)
        pooled = pool.starmap(chunk_sum, [(X, i) for i in range(8)])
    ours = f"/proc/{os.getpid()}/fd/"

    def report(name, got):
        stats = memshare.last_call_stats()
        values = all(r[2][-1] == i and r[3][-1] == i for i, r in enumerate(got))
        referenced = stats["results_by_reference"]
        sent = stats["arrays_dumped"] + stats["arrays_held_once"]
        print(name, got[0][0], got[0][1].startswith(ours), sent, referenced, values)

    report("POOL", pooled)
    report("JOBLIB", Parallel(n_jobs=2)(delayed(chunk_sum)(X, i) for i in range(8)))
"""


@pytest.mark.version_independent
@pytest.mark.parametrize("promote", ["1", "0"], ids=["held-once", "dumped"])
def test_read_only_shm_and_temp_dir_still_share_through_memory(promote, tmp_path):
    temp = _temp_dir(tmp_path)
    result = run_with_private_mounts(
        READ_ONLY_RUN,
        {"/dev/shm": "size=64m", temp: "size=64m"},
        extra_env={"MEMSHARE_PROMOTE": promote, "TMPDIR": temp},
    )
    assert result.returncode == 0, result.stderr
    assert "READ-ONLY /dev/shm/x 30" in result.stdout and f"READ-ONLY {temp}/x 30" in result.stdout
    # Results: an array and a handed-over shared array per task (the pool's figures count its first task too).
    # X goes through memory in every call: dumped once per call, or held once since the first call, before
    # the mounts became read-only (so no call after that writes it again).
    sent = 1 if promote == "0" else 0
    assert f"POOL {float(2**20)} True {sent} 18 True" in result.stdout
    assert f"JOBLIB {float(2**20)} True {sent} 16 True" in result.stdout


def _doctor(*args, env=None):
    full_env = without_location_settings()
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "memshare", "doctor", *args], env=full_env, capture_output=True, text=True, timeout=60
    )


def test_doctor_names_the_mechanism_and_lists_live_memfds_by_owner():
    shared = memshare.zeros(3 * MIB // 8)
    report = _doctor()
    assert "Mechanism\n  memfds: memfd_create works" in report.stdout
    owner_line = next(line for line in report.stdout.splitlines() if line.startswith(f"  pid {os.getpid()}:"))
    # Arrays held once by earlier tests of this process may be listed too.
    assert re.search(r"\b1 shared\b", owner_line), owner_line
    del shared
    switched = _doctor(env={"MEMSHARE_MEMFD": "0"})
    assert "Mechanism\n  named files in " in switched.stdout and "MEMSHARE_MEMFD=0 turns memfds off" in switched.stdout


@pytest.mark.version_independent
def test_doctor_with_memfds_notes_a_small_shm_instead_of_failing(small_tmpfs):
    report = _doctor("--shm", str(small_tmpfs))
    assert report.returncode == 0, report.stdout
    assert "NOTE: " in report.stdout and "is only 64.0 MiB" in report.stdout
    assert "OK: memshare can share arrays through memfds" in report.stdout


def full_with_pid(n, value):
    return os.getpid(), np.full(n, value)


def test_results_pass_their_memfds_to_the_parent_and_no_descriptor_stays_open(default_location):
    gc.collect()
    before = len(memfds_held())
    session = Session(Settings(max_nbytes=1024))
    try:
        task = session.pack_task(np.full, ((1000,), 3.0))
        assert task.results.inbox is not None
        outcome = run_task(task)  # in this process: the worker's side of the hand-over, then the parent's
        assert [ref.path.startswith(f"/proc/{os.getpid()}/fd/") for ref in outcome.result_files()] == [True]
        assert len(memfds_held()) == before  # sent, then closed: the descriptor is in flight
        ok, value = session.finish(outcome)
        assert ok and type(value) is np.ndarray and value.flags.writeable and value.sum() == 3000.0
        assert len(memfds_held()) == before  # mapped, then closed: the mapping keeps no descriptor
        del value
        gc.collect()
        assert len(memfds_held()) == before
    finally:
        session.close()

    results = Parallel(n_jobs=2)(delayed(full_with_pid)(200_000, float(i)) for i in range(6))
    assert [float(array[-1]) for _, array in results] == [float(i) for i in range(6)]
    assert memshare.last_call_stats()["results_by_reference"] == 6
    workers = {pid for pid, _ in results}
    del results
    gc.collect()
    assert len(memfds_held()) == before
    assert [memfds_held(pid) for pid in workers] == [[] for _ in workers]


def test_a_call_never_restored_closes_what_its_workers_sent(default_location):
    gc.collect()
    before = len(memfds_held())
    session = Session(Settings(max_nbytes=1024))
    outcomes = [run_task(session.pack_task(np.full, ((1000,), float(i)))) for i in range(3)]
    session.task_done(outcomes[0].token)  # abandoned: nobody restores these outcomes
    session.close()
    assert len(memfds_held()) == before
    assert [len(o.result_files()) for o in outcomes] == [1, 1, 1]


SEND_THEN_DIE = """
    import os, signal, sys
    from memshare._transport import _handoff
    from memshare._lifetime._folders import FolderPair
    path, fd = FolderPair("/nonexistent", None, in_memory=True).create_file(4096, "result")
    info = os.fstat(fd)
    lie = sys.argv[3] == "lie"
    _handoff.send(chr(0) + sys.argv[1], int(sys.argv[2]), [(fd, (info.st_dev, info.st_ino + lie))])
    os.kill(os.getpid(), signal.SIGKILL)  # after sending, before any outcome
"""


@pytest.mark.parametrize("announced", ["truth", "lie"])
def test_an_inbox_keeps_only_what_was_announced_and_closes_the_rest(announced):
    gc.collect()
    before = len(memfds_held())
    inbox = Inbox()
    try:
        child = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(SEND_THEN_DIE), inbox.address[1:], str(os.getpid()), announced],
            capture_output=True,
            timeout=60,
        )
        assert child.returncode == -signal.SIGKILL, child.stderr
        inbox.discard([])  # takes nothing
        kept = 1 if announced == "truth" else 0  # a descriptor that is not what its message says is closed
        assert inbox.held() == kept and len(memfds_held()) == before + kept
    finally:
        inbox.close()
    assert inbox.held() == 0 and len(memfds_held()) == before


def test_a_worker_refuses_to_send_to_an_inbox_its_parent_does_not_hold():
    inbox = Inbox()
    try:
        with pytest.raises(PermissionError, match="not by the parent"):
            _handoff.send(inbox.address, os.getpid() + 1, [])
    finally:
        inbox.close()
    with pytest.raises(ConnectionRefusedError):
        _handoff.send(inbox.address, os.getpid(), [])  # closed: the parent finished the call, or died


def test_an_inbox_collected_unclosed_closes_what_it_received():
    gc.collect()
    before = len(memfds_held())
    inbox = Inbox()
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SEND_THEN_DIE), inbox.address[1:], str(os.getpid()), "truth"],
        capture_output=True,
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert inbox.held() == 1  # reads what is queued
    assert len(memfds_held()) == before + 1
    del inbox
    gc.collect()
    assert len(memfds_held()) == before


def shared_filled(n, value):
    out = memshare.full(n, value)
    return out, out[1:]  # two views of one array: one memfd, handed over once


def _mapping_of(array):
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return line.split(None, 5)[5].strip() if len(line.split(None, 5)) == 6 else ""
    return ""


def test_a_workers_shared_array_comes_back_as_its_own_pages(default_location):
    gc.collect()
    before = len(memfds_held())
    results = Parallel(n_jobs=2)(delayed(shared_filled)(2**18, float(i)) for i in range(3))
    for i, (whole, tail) in enumerate(results):
        assert whole[0] == i and tail[-1] == i and tail.size == whole.size - 1
        assert _mapping_of(whole).startswith("/memfd:memshare-shared-")  # the worker's memory, not a copy
        whole[1] = -1.0
        assert tail[0] == -1.0  # both views share it in the parent too
    del results, whole, tail
    gc.collect()
    assert len(memfds_held()) == before
