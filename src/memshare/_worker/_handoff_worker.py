"""A task's side of the memfd hand-over: its memfds sent to the parent, named files for what cannot go.

:class:`ResultHandover` uses the channel of ``_handoff`` for one task. It
never makes the worker wait for its parent, nor runs it out of descriptors:
what the parent cannot take now is copied into named result files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import socket
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

from .._numpy import np

try:
    import resource
except ImportError:  # not a Unix: no descriptor limit to read, and no memfds either
    resource = None  # type: ignore[assignment]

from .._errors import SharedMemoryFullError
from .._lifetime import _memfd, _procfs
from .._stats import logger
from .._transport import _handoff
from .._transport._handoff import Identity
from .._transport._protocol import ResultSpec, Slot
from .._transport._refs import RESULT, SHARED, ArrayRef, file_identity
from ._result_files import MadeFiles

_COPY_BYTES = 8 * 1024**2  # block size when a result memfd is copied into a named file

#: Where the memory of a memfd the parent could not take went: a named file (its path and
#: identity), or a byte array to send by value when no file had room.
Moved = Union[Tuple[str, Identity], "np.ndarray"]


class ResultHandover:
    """One task's memfds for the parent: its memfd results, and the shared arrays it hands over.

    The connection to the parent's inbox is made, without waiting, before
    the first memfd: when the inbox cannot take it at once (its queue is
    full), the task's results are named files instead. At most
    ``MEMFD_RESULTS_PER_TASK`` per task are memfds, and no more than the
    process's descriptor limit leaves room for (``SPARE_DESCRIPTORS`` kept
    free for the rest), so that a task returning thousands of arrays cannot
    run the worker, or the descriptors in flight, out of their limit (the
    rest are named files).
    """

    MEMFD_RESULTS_PER_TASK = 128
    #: Descriptors a task leaves free for everything but its memfds: named result files, the
    #: connection, the descriptors duplicated for one message (``SEND_BATCH``), the user's own.
    SPARE_DESCRIPTORS = 32
    #: Memfds passed per message: each is duplicated for its message only, then closed with its original.
    SEND_BATCH = 16

    def __init__(self, spec: ResultSpec, made: MadeFiles) -> None:
        self._spec = spec
        self._named = dataclasses.replace(spec.folder, in_memory=False)
        self._made = made  # the task's files: memfd results are sent from it, named copies added to it
        # Shared arrays of this worker handed over as memfds: descriptors opened for sending.
        self._handed: List[int] = []
        self._memfd_results = 0  # memfds this task holds for the parent: results and handed-over arrays
        self._memfd_cap: Optional[int] = None  # how many it may hold, worked out at the first one
        # The connection to the parent's inbox, made at the first memfd; None before, or when unreachable.
        self._connection: Optional[socket.socket] = None
        self._unreachable = False

    def take_memfd(self) -> bool:
        """True when one more result may be a memfd for the parent, which is then counted; False: a named file."""
        if not self._room_for_memfd():
            return False
        self._memfd_results += 1
        return True

    def hand_over(self, ref: ArrayRef) -> Optional[ArrayRef]:
        """Give the parent a shared array this worker allocated, with no copy; None when it cannot.

        A memfd is passed to the parent (see :meth:`send`). A named file gets
        a second name in the call's folder, which the parent adopts like any
        result file; the worker's own name goes when its array is
        garbage-collected. Both then map the same pages.
        """
        if _memfd.is_memfd_path(ref.path):
            # Two views of one array: one descriptor.
            if (ref.device, ref.inode) not in (file_identity(os.fstat(fd)) for fd in self._handed):
                if not self._room_for_memfd():
                    return None
                fd = os.open(ref.path, os.O_RDWR | os.O_CLOEXEC)  # a magic link: checked after opening
                if file_identity(os.fstat(fd)) != (ref.device, ref.inode) or _memfd.kind_of_descriptor(fd) != SHARED:
                    os.close(fd)
                    return None
                self._handed.append(fd)
                self._memfd_results += 1
            return dataclasses.replace(ref, kind=RESULT, mode="r+")
        path = self._spec.folder.link_file(ref.path, RESULT)
        if path is None:
            return None
        self._made.add(path)
        return dataclasses.replace(ref, path=path, kind=RESULT, mode="r+")

    def send(self, slots: Sequence[Optional[Slot]]) -> Dict[Identity, Moved]:
        """Pass the parent the descriptors of every memfd promised, closing this worker's own as it goes.

        ``slots`` is the task's slot table, written: its memfd result files
        made by this task are sent, with the shared arrays handed over. Call
        it before returning the outcome, so that they are queued at the
        parent when the outcome arrives. They go ``SEND_BATCH`` at a time,
        each duplicated for its message only and closed with its original
        once queued, so that sending needs few descriptors beyond those the
        results hold. What the parent cannot take now (a send that timed
        out, too many descriptors in flight) is copied into named result
        files: the answer says, by (device, inode), where each such memfd's
        memory went, for the slots that name it. Raises OSError when the
        parent's inbox is gone.
        """
        try:
            with descriptor_limit_explained():
                return self._send(slots)
        finally:
            self._close_connection()

    def close(self) -> None:
        """Close the descriptors not sent and the connection; the files are the caller's to delete."""
        for fd in self._handed:
            os.close(fd)
        self._handed.clear()
        self._close_connection()

    def _room_for_memfd(self) -> bool:
        """True when one more memfd may go to the parent: the inbox is connected and descriptors allow."""
        if self._memfd_cap is None:
            free = _free_descriptors()
            room = self.MEMFD_RESULTS_PER_TASK if free is None else free - self.SPARE_DESCRIPTORS
            self._memfd_cap = max(0, min(self.MEMFD_RESULTS_PER_TASK, room))
            if self._memfd_cap < self.MEMFD_RESULTS_PER_TASK:
                logger.debug(
                    "memshare: at most %d results of this task are memfds: %s descriptors free (ulimit -n)",
                    self._memfd_cap,
                    free,
                )
        return self._memfd_results < self._memfd_cap and self._inbox_connection() is not None

    def _inbox_connection(self) -> Optional[socket.socket]:
        """The connection to the parent's inbox, made at the first memfd; None: named files for this task.

        Made without waiting (see ``_handoff.connect``). An inbox that is
        there but cannot take a connection now (its queue is full: the
        parent is far behind, or another process filled it) leaves named
        files; an inbox that is gone (the call is over) raises, as sending
        to it would.
        """
        if self._connection is None and not self._unreachable and self._spec.inbox is not None:
            try:
                self._connection = _handoff.connect(self._spec.inbox, self._spec.owner)
            except OSError as exc:
                if not _parent_busy(exc):
                    raise
                self._unreachable = True
                logger.info("memshare: this task's results are named files: the parent's inbox is busy (%s)", exc)
        return self._connection

    def _send(self, slots: Sequence[Optional[Slot]]) -> Dict[Identity, Moved]:
        results = [
            s.path for s in slots if isinstance(s, ArrayRef) and s.path in self._made and _memfd.is_memfd_path(s.path)
        ]
        if not results and not self._handed:
            return {}
        connection = self._connection  # memfds are made only once it is connected
        if connection is None:
            raise ConnectionError("memshare: result memfds were made without a connection to the parent")
        try:
            while results:
                batch = results[: self.SEND_BATCH]
                fds: List[int] = []
                try:
                    for path in batch:
                        fds.append(_memfd.duplicate(path))
                    _handoff.send_on(connection, [(fd, file_identity(os.fstat(fd))) for fd in fds])
                finally:
                    for fd in fds:
                        os.close(fd)
                # Queued at the parent now: its copies keep the memory, ours can go.
                for path in batch:
                    self._made.delete(path)
                del results[: len(batch)]
            while self._handed:
                batch = self._handed[: self.SEND_BATCH]
                _handoff.send_on(connection, [(fd, file_identity(os.fstat(fd))) for fd in batch])
                for fd in batch:
                    os.close(fd)
                del self._handed[: len(batch)]
        except OSError as exc:
            if not _parent_busy(exc):
                raise
            logger.info(
                "memshare: %d results of this task are named files: the parent could not take their memfds now (%s)",
                len(results) + len(self._handed),
                exc,
            )
            return self._to_named_files(results)
        return {}

    def _to_named_files(self, results: List[str]) -> Dict[Identity, Moved]:
        """Copy the memfds not sent (``results``, and the shared arrays still held) into named result files.

        Each then has a copy, or its bytes to send by value when no file has
        room for them (the parent warns about either).
        """
        moved: Dict[Identity, Moved] = {}
        for path in results:
            fd = _memfd.duplicate(path)
            try:
                self._copy_out(fd, moved)
            finally:
                os.close(fd)
            self._made.delete(path)
        while self._handed:
            self._copy_out(self._handed[0], moved)
            os.close(self._handed.pop(0))
        return moved

    def _copy_out(self, source: int, moved: Dict[Identity, Moved]) -> None:
        identity, size = file_identity(os.fstat(source)), os.fstat(source).st_size
        try:
            path, fd = self._named.create_file(size, RESULT, warn=False)  # the parent warns
        except SharedMemoryFullError:
            moved[identity] = _read_all(source, size)
            return
        self._made.add(path)
        try:
            _copy_file(source, fd, size)
            moved[identity] = (path, file_identity(os.fstat(fd)))
        finally:
            os.close(fd)

    def _close_connection(self) -> None:
        if self._connection is not None:
            self._connection.close()  # the parent reads what was queued before the close
            self._connection = None


#: errno values of a send or connect meaning that the parent's inbox is there but cannot take more now.
_BUSY_ERRNOS = (errno.EAGAIN, errno.ETIMEDOUT, errno.ETOOMANYREFS, errno.ENOBUFS)


def _parent_busy(exc: OSError) -> bool:
    """True when ``exc`` says the inbox cannot take descriptors now (named files then); False: it is gone."""
    return isinstance(exc, (BlockingIOError, socket.timeout)) or exc.errno in _BUSY_ERRNOS


def _free_descriptors() -> Optional[int]:
    """How many more descriptors this process may open now; None when there is no limit to speak of."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        open_now = len(_procfs.descriptors()) - 1  # listdir's own descriptor is gone again
    except OSError:
        return None
    return soft - open_now


@contextlib.contextmanager
def descriptor_limit_explained() -> Iterator[None]:
    """Raise a worker running out of descriptors as what it is, with the limit and the fix (not as "no room")."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE) or str(exc).startswith("memshare:"):
            raise
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if resource is not None else "?"
        which = "this worker's limit" if exc.errno == errno.EMFILE else "the system's limit"
        raise OSError(
            exc.errno,
            f"memshare: a worker ran out of file descriptors ({which}; ulimit -n is {soft}) while "
            f"sending a result back ({exc.strerror}). Raise the limit (ulimit -n, or resource.setrlimit "
            "in the pool's initializer), or return fewer separate large arrays per task (stack them into one)",
        ) from exc


def _copy_file(source: int, target: int, nbytes: int) -> None:
    """Copy the first ``nbytes`` of ``source`` into ``target``, from its start."""
    done = 0
    while done < nbytes:
        block = memoryview(os.pread(source, min(_COPY_BYTES, nbytes - done), done))
        if not block:
            raise OSError(f"memshare: a result memfd is shorter than its {nbytes} bytes")
        written = 0
        while written < len(block):
            written += os.pwrite(target, block[written:], done + written)
        done += written


def _read_all(source: int, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of ``source``, as a new byte array."""
    data = np.empty(nbytes, np.uint8)
    view = memoryview(data)
    done = 0
    while done < nbytes:
        count = os.preadv(source, [view[done:]], done)
        if count == 0:
            raise OSError(f"memshare: a result memfd is shorter than its {nbytes} bytes")
        done += count
    return data


__all__ = ["Moved", "ResultHandover", "descriptor_limit_explained"]
