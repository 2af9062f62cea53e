"""A MemmappingPool whose worker died abruptly: every way of finishing it returns, and leaves nothing behind.

A worker killed while it holds one of the pool's queue locks takes the lock with it. The tests make that
happen on purpose: the task finds its worker's result queue in the pool's worker function and takes its
write lock, as the worker does while it writes a result, before it is killed.
"""

import multiprocessing
import os
import pickle
import signal
import struct
import sys
import threading
import time

import numpy as np
import pytest
from conftest import alive, memshare_entries, wait_until

import memshare
from memshare import MemmappingPool
from memshare._compat._pool_queues import ResultPipe

PROMPTLY = 30  # seconds: anything slower is a hang


def pid(_):
    return os.getpid()


def queue_of_this_worker(name):
    """The queue ``name`` ("inqueue" for tasks, "outqueue" for results) of the pool worker running this task:
    a local of multiprocessing's worker function."""
    frame = sys._getframe()
    while frame is not None and name not in frame.f_locals:
        frame = frame.f_back
    assert frame is not None, "not run by a multiprocessing pool worker"
    return frame.f_locals[name]


def take_the_result_lock_then_sleep(cue, halfway):
    """Hold the result queue's write lock, as a worker does while it writes; halfway: with half a message written."""
    queue = queue_of_this_worker("outqueue")
    queue._wlock.acquire()
    if halfway:
        os.write(queue._writer.fileno(), struct.pack("!i", 1 << 20) + b"x" * 1000)
    with open(cue, "w") as marker:
        marker.write(str(os.getpid()))
    time.sleep(60)


def sleep_then_return(cue, seconds):
    with open(cue, "w") as marker:
        marker.write(str(os.getpid()))
    time.sleep(seconds)
    return seconds


def returns_within(seconds, finish):
    """Run ``finish`` in a thread of its own; True when it returned within ``seconds`` (False: it hangs)."""
    done = threading.Event()

    def run():
        finish()
        done.set()

    threading.Thread(target=run, name="finish", daemon=True).start()
    return done.wait(seconds)


def pid_in(cue):
    assert wait_until(lambda: cue.exists() and cue.read_text() != "", PROMPTLY), "the task never started"
    return int(cue.read_text())


@pytest.mark.parametrize("halfway", [False, True], ids=["between-messages", "halfway-through-a-message"])
@pytest.mark.parametrize("finish", ["terminate", "close-join"])
def test_a_worker_killed_holding_the_result_lock_fails_its_call_and_the_pool_still_finishes(
    shm_dir, tmp_path, halfway, finish
):
    pool = MemmappingPool(2)
    try:
        assert pool.map(np.sum, [np.ones(300_000)] * 4) == [300_000.0] * 4  # a folder, and results read
        cue = tmp_path / "cue"
        pending = pool.apply_async(take_the_result_lock_then_sleep, (str(cue), halfway))
        worker = pid_in(cue)
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(memshare.WorkerDiedError, match="SIGKILL"):
            pending.get(timeout=PROMPTLY)
        workers = [process.pid for process in pool._pool]
    finally:
        finishing = pool.terminate if finish == "terminate" else (lambda: (pool.close(), pool.join()))
        assert returns_within(PROMPTLY, finishing), f"{finish} hangs"
    assert not any(alive(other) for other in workers)
    assert memshare_entries(shm_dir) == []


def test_close_and_join_return_when_an_idle_worker_was_killed(shm_dir):
    # An idle worker waits for a task holding the task queue's read lock: killed there, no other worker
    # can ever read a task, the sentinels that end them included.
    pool = MemmappingPool(2)
    workers = set(pool.map(pid, range(20)))
    for worker in workers:
        os.kill(worker, signal.SIGKILL)
    assert wait_until(lambda: pool._watch.broken is not None, PROMPTLY), "the pool never saw its workers die"
    with pytest.raises(memshare.WorkerDiedError, match="create a new one"):
        pool.apply_async(pid, (0,))
    assert returns_within(PROMPTLY, lambda: (pool.close(), pool.join())), "close() then join() hang"
    assert not any(alive(process.pid) for process in pool._pool)
    assert memshare_entries(shm_dir) == []


def reading_a_task(worker):
    """True when ``worker`` waits in a read of the task pipe: the idle worker that holds the queue's read lock.

    The others wait for that lock, in a futex. The kernel names where a process sleeps in ``wchan``
    (``pipe_read``, or ``anon_pipe_read`` on newer kernels).
    """
    with open(f"/proc/{worker}/wchan") as wchan:
        return "pipe_read" in wchan.read()


@pytest.mark.parametrize("when", ["before join", "while join waits"])
@pytest.mark.parametrize("method", ["forkserver", "fork"])
def test_join_returns_when_an_idle_worker_is_killed_after_close(shm_dir, method, when):
    # Nothing is pending, so no call fails and the watch has ended; the other workers wait behind the dead
    # one's lock for the sentinels that end them, and join() waited for them forever.
    pool = MemmappingPool(2, context=method)
    try:
        workers = sorted(set(pool.map(pid, range(20), chunksize=1)) | {process.pid for process in pool._pool})
        if not wait_until(lambda: any(map(reading_a_task, workers)), PROMPTLY):
            if not any(open(f"/proc/{worker}/wchan").read().strip("0") for worker in workers):
                pytest.skip("this kernel does not say where a process sleeps (/proc/PID/wchan reads 0)")
            raise AssertionError("no worker waits for a task")
        holder = next(worker for worker in workers if reading_a_task(worker))
        os.kill(holder, signal.SIGSTOP)  # it reads no sentinel, and keeps the lock, until it is killed
        pool.close()
        joined = threading.Event()
        if when == "before join":
            os.kill(holder, signal.SIGKILL)
        threading.Thread(target=lambda: (pool.join(), joined.set()), daemon=True).start()
        if when == "while join waits":
            assert not joined.wait(0.5)  # the other worker waits for the lock, so join() does too
            os.kill(holder, signal.SIGKILL)
        assert joined.wait(PROMPTLY), "join() hangs after an idle worker died"
    finally:
        pool.terminate()
    assert not any(alive(worker) for worker in workers)
    assert memshare_entries(shm_dir) == []


def test_a_worker_killed_while_join_waits_fails_the_pending_calls(shm_dir, tmp_path):
    pool = MemmappingPool(2)
    try:
        cue = tmp_path / "cue"
        pending = pool.apply_async(sleep_then_return, (str(cue), 60))
        worker = pid_in(cue)
        pool.close()
        joined = threading.Event()
        threading.Thread(target=lambda: (pool.join(), joined.set()), daemon=True).start()
        assert not joined.wait(0.5)  # join waits for the call
        os.kill(worker, signal.SIGKILL)
        assert joined.wait(PROMPTLY), "join() hangs after a worker died"
        with pytest.raises(memshare.WorkerDiedError, match="SIGKILL"):
            pending.get(timeout=0)
    finally:
        pool.terminate()
    assert memshare_entries(shm_dir) == []


def test_a_closed_pool_still_finishes_its_calls_and_its_watch_ends(shm_dir, tmp_path):
    pool = MemmappingPool(2)
    results = [pool.apply_async(sleep_then_return, (str(tmp_path / f"cue{i}"), 0.2)) for i in range(4)]
    watch = pool._watch._thread
    pool.close()
    assert [result.get(timeout=PROMPTLY) for result in results] == [0.2] * 4
    assert wait_until(lambda: not watch.is_alive(), PROMPTLY), "the watch outlived the pool's calls"
    pool.join()
    assert memshare_entries(shm_dir) == []


# -- the parent's reader of the result pipe ------------------------------------------------------------


def test_the_result_reader_reads_what_a_connection_sends_in_its_framing():
    reader, writer = multiprocessing.Pipe(duplex=False)
    pipe = ResultPipe(reader)
    messages = [None, ("small", 1), b"x" * 70_000, np.arange(700_000), list(range(10))]
    sender = threading.Thread(target=lambda: [writer.send(message) for message in messages])
    sender.start()
    received = [pipe.recv() for _ in messages]
    sender.join()
    assert received[:3] == messages[:3] and received[4] == messages[4]
    assert np.array_equal(received[3], messages[3])
    # The header of a message over 2 GiB: -1, then its length in 8 bytes.
    data = pickle.dumps("announced with a long header")
    os.write(writer.fileno(), struct.pack("!i", -1) + struct.pack("!Q", len(data)) + data)
    assert pipe.recv() == "announced with a long header"
    writer.close()
    with pytest.raises(EOFError):
        pipe.recv()  # every writer is gone
    reader.close()


def test_the_result_reader_stops_when_told_even_halfway_through_a_message():
    reader, writer = multiprocessing.Pipe(duplex=False)
    pipe = ResultPipe(reader)
    os.write(writer.fileno(), struct.pack("!i", 1 << 20) + b"x" * 1000)  # a writer that died in mid-message
    outcome = []

    def receive():
        try:
            pipe.recv()
        except EOFError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # waits for the rest of the message
    pipe.stop()
    thread.join(PROMPTLY)
    assert not thread.is_alive() and isinstance(outcome[0], EOFError)
    writer.close()
    reader.close()


def take_the_task_lock_then_sleep(cue):
    """Hold the task queue's read lock, as an idle worker does while it reads the next task."""
    queue_of_this_worker("inqueue")._rlock.acquire()
    with open(cue, "w") as marker:
        marker.write(str(os.getpid()))
    time.sleep(60)


def test_a_worker_killed_holding_the_task_lock_leaves_no_thread_writing_a_large_task(shm_dir, tmp_path):
    # Arrays go in the task (max_nbytes=None): 8 MB that nobody reads, since the only worker that could
    # read it holds the lock and is killed. The task thread was left writing it forever.
    pool = MemmappingPool(1, max_nbytes=None)
    try:
        cue = tmp_path / "cue"
        first = pool.apply_async(take_the_task_lock_then_sleep, (str(cue),))
        worker = pid_in(cue)
        large = pool.apply_async(np.sum, (np.ones(1_000_000),))
        time.sleep(0.5)  # the task thread writes what fits in the pipe, then waits for room
        os.kill(worker, signal.SIGKILL)
        for result in (first, large):
            with pytest.raises(memshare.WorkerDiedError, match="SIGKILL"):
                result.get(timeout=PROMPTLY)
    finally:
        assert returns_within(PROMPTLY, pool.terminate), "terminate hangs"
    assert wait_until(lambda: not pool._task_handler.is_alive(), PROMPTLY), "the task thread is still writing"
    assert memshare_entries(shm_dir) == []
