"""Forking while memshare's threads run: locks reset in the child, no fork of a threaded parent by default."""

from __future__ import annotations

import os
import threading

import pytest
from conftest import run_script

from memshare import _forksafe, _stats

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() exists on POSIX only")


def _child_can_take(lock) -> bool:
    """Fork while another thread holds ``lock``; True if the child could take it."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(30)
    try:
        pid = os.fork()
        if pid == 0:  # the child: only this thread exists, the holder does not
            os._exit(0 if lock.acquire(timeout=5) else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        holder.join()
    return os.waitstatus_to_exitcode(status) == 0


@needs_fork
@pytest.mark.parametrize("make", [_forksafe.lock, _forksafe.rlock])
def test_a_lock_held_by_another_thread_is_free_in_a_forked_child(make):
    assert _child_can_take(make())


@needs_fork
def test_memshare_module_locks_are_fork_safe():
    assert _child_can_take(_stats._last_lock)  # last_call_stats() in a forked child must not deadlock


FORK_RECORDER = """
import os, threading
forks = []
real_fork = os.fork


def recording_fork():
    forks.append(sorted(t.name for t in threading.enumerate() if t is not threading.current_thread()))
    return real_fork()


os.fork = recording_fork
import memshare


def double(x):
    return 2 * x
"""


@needs_fork
def test_the_default_pool_never_forks_the_threaded_parent(shm_dir):
    result = run_script(
        FORK_RECORDER
        + """
with memshare.MemmappingPool(2, maxtasksperchild=1) as pool:  # workers are replaced from the pool's threads
    assert pool.map(double, range(6), chunksize=1) == [0, 2, 4, 6, 8, 10]
print(forks)
"""
    )
    assert result.stdout.strip() == "[]"


@needs_fork
def test_no_memshare_thread_outlives_a_fork_pool(shm_dir):
    result = run_script(
        FORK_RECORDER
        + """
for _ in range(3):
    with memshare.MemmappingPool(2, context="fork") as pool:
        assert pool.map(double, range(4)) == [0, 2, 4, 6]
print([names for names in forks if any(name.startswith("memshare") for name in names)])
print(len(forks))
"""
    )
    others, count = result.stdout.split()
    assert others == "[]" and count == "6"
