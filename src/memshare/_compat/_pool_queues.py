"""A pool's two queues at the parent's end: never waiting forever on a worker that died.

Workers write results under the queue's write lock, a semaphore shared with
the parent. A worker killed while it holds it (between its write and its
release, a window that lasts as long as the scheduler leaves it off the CPU)
takes it with it: the standard pool's ``terminate()`` then waits forever to
write the sentinel that ends its result thread, and so does its task thread.
A worker killed halfway through a large message leaves the result thread
waiting forever for the rest.

Here the parent writes its sentinels through :class:`ParentPut`, which waits
for the lock only while the results still matter: once a worker died
abruptly or the pool is terminating, it stops the result thread through
:class:`ResultPipe` instead. The result thread reads the pipe through
:class:`ResultPipe`, in ``Connection``'s own framing, and stops when told
even in the middle of a message.

The task queue has the same hazard the other way: a worker killed while it
reads a task larger than the pipe (an idle worker holds the queue's read
lock) leaves the task thread blocked writing the rest, forever, since no
other worker can take the lock. :class:`TaskSender` writes without blocking
and gives up once the results are abandoned.
"""

from __future__ import annotations

import os
import select
import struct
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

_READ_AHEAD = 1 << 16  # bytes read at once while small messages are pending: several results per read
_LOOK_AGAIN = 0.05  # seconds between two looks at whether the results still matter
_SIZE = struct.Struct("!i")  # Connection's length header; -1 announces an 8-byte one
_LARGE_SIZE = struct.Struct("!Q")
_SMALL = 16384  # bytes: a message up to this size is written with its header in one write, as Connection does


def _close_all(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


class ResultPipe:
    """The read end of a pool's result pipe, read as ``Connection.recv`` reads it, until :meth:`stop`.

    ``Connection`` frames each message with a 4-byte signed length, or -1 and
    an 8-byte length above 2 GiB. Only the pool's result thread reads.
    """

    def __init__(self, connection: Any) -> None:
        self._connection = connection  # keeps the descriptor open
        self._fd = connection.fileno()
        # Non-blocking: a read tries first and waits only for an empty pipe. The workers share this
        # end's flags but never read it.
        os.set_blocking(self._fd, False)
        self._pending = bytearray()
        self._scratch = bytearray(_READ_AHEAD)
        self._stopped = False
        self._stop_r, self._stop_w = os.pipe()
        os.set_blocking(self._stop_w, False)
        # poll, not select: the pool's pipes may be numbered above select's limit (1024) in a process
        # holding thousands of memfds.
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLIN)
        self._poller.register(self._stop_r, select.POLLIN)
        # The stop pipe goes with this object: when the pool's threads and queues let go of it. Not at
        # exit: the pool's result thread may still poll it then, and a number closed early may be reused.
        weakref.finalize(self, _close_all, self._stop_r, self._stop_w).atexit = False

    def recv(self) -> Any:
        """The next message, unpickled; ``EOFError`` once stopped or when every writer is gone."""
        pending = self._pending
        if len(pending) >= 4:  # the usual case: a whole small message was read ahead with the one before
            (size,) = _SIZE.unpack_from(pending)
            if 0 <= size <= len(pending) - 4:
                message = pending[4 : 4 + size]
                del pending[: 4 + size]
                return ForkingPickler.loads(message)
        (size,) = _SIZE.unpack(self._take(4))
        if size == -1:
            (size,) = _LARGE_SIZE.unpack(self._take(8))
        return ForkingPickler.loads(self._take(size))

    def stop(self) -> None:
        """Make the reader's current and next :meth:`recv` raise ``EOFError``, even halfway through a message."""
        self._stopped = True
        try:
            os.write(self._stop_w, b"x")
        except BlockingIOError:
            pass  # a wake-up is pending already

    def _take(self, size: int) -> Any:
        pending = self._pending
        if len(pending) < size <= _READ_AHEAD:
            while len(pending) < size:
                pending += memoryview(self._scratch)[: self._read(self._scratch)]
        if len(pending) >= size:
            taken = pending[:size]
            del pending[:size]
            return taken
        # A large message: what was read ahead, then the rest straight into place.
        message = bytearray(size)
        view = memoryview(message)
        done = len(pending)
        view[:done] = pending
        pending.clear()
        while done < size:
            done += self._read(view[done:])
        return message

    def _read(self, into: Any) -> int:
        while not self._stopped:
            try:
                count = os.readv(self._fd, [into])
            except BlockingIOError:
                # Until there is something to read, or a stop; a descriptor closed under it ends the reading.
                if any(event & select.POLLNVAL for _, event in self._poller.poll()):
                    raise EOFError("the pool's result pipe was closed") from None
                continue
            if count == 0:
                raise EOFError("every writer of the pool's result pipe is gone")
            return count
        raise EOFError("the pool's results are no longer read")


class ParentPut:
    """The parent's ``put`` on its result queue: the sentinels of ``close()`` and ``terminate()``.

    It waits for the queue's write lock while ``results_abandoned()`` is
    false, since a live worker holding it releases it once its result is
    read. Once it is true, the holder may be dead: the result thread is
    stopped instead of being sent the sentinel.
    """

    def __init__(self, queue: Any, pipe: ResultPipe, results_abandoned: Callable[[], bool]) -> None:
        self._lock = queue._wlock
        self._send_bytes = queue._writer.send_bytes
        self._pipe = pipe
        self._results_abandoned = results_abandoned
        self._parent = os.getpid()

    def __call__(self, message: Any) -> None:
        data = ForkingPickler.dumps(message)
        if self._lock is None:
            self._send_bytes(data)
            return
        if os.getpid() != self._parent:
            # A worker forked from the parent has this queue as it is, and writes its results through
            # it: as the standard queue does, whatever the parent's state was when it forked.
            with self._lock:
                self._send_bytes(data)
            return
        while not self._lock.acquire(timeout=_LOOK_AGAIN):
            if self._results_abandoned():
                self._pipe.stop()
                return
        try:
            self._send_bytes(data)
        finally:
            self._lock.release()


class TaskSender:
    """The pool's ``put`` of tasks (its task thread is the queue's one writer): ``Connection.send``'s framing.

    It writes without blocking and waits for room in the pipe only while
    ``results_abandoned()`` is false; then it raises ``BrokenPipeError``,
    which the task thread takes as the end of its writing.
    """

    def __init__(self, connection: Any, results_abandoned: Callable[[], bool]) -> None:
        self._connection = connection  # keeps the descriptor open
        self._fd = connection.fileno()
        # The workers share this end's flags but never write to it.
        os.set_blocking(self._fd, False)
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLOUT)
        self._results_abandoned = results_abandoned

    def __call__(self, message: Any) -> None:
        data = ForkingPickler.dumps(message)
        size = len(data)
        if size <= _SMALL:
            self._write(_SIZE.pack(size) + data)  # one write for a small message
            return
        self._write(_SIZE.pack(size) if size <= 0x7FFFFFFF else _SIZE.pack(-1) + _LARGE_SIZE.pack(size))
        self._write(data)

    def _write(self, data: Any) -> None:
        try:
            written = os.write(self._fd, data)  # the usual case: room for all of it
        except BlockingIOError:
            written = 0
        if written == len(data):
            return
        view = memoryview(data)[written:]
        while view:
            try:
                view = view[os.write(self._fd, view) :]
            except BlockingIOError:
                while not self._poller.poll(_LOOK_AGAIN * 1000):  # milliseconds
                    if self._results_abandoned():
                        raise BrokenPipeError("memshare: the pool's workers will read no more tasks") from None


__all__ = ["ParentPut", "ResultPipe", "TaskSender"]
