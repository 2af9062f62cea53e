"""The drop log: how a parent tells its workers which broadcasts it dropped, at a cost per drop, not per copy.

A worker may hold thousands of broadcast copies, so it does not look at each
before every task. The parent records the token of each broadcast whose
file it deleted in a small shared array, a ring of the last ``DROP_SLOTS``
tokens after a count; every broadcast carries the log's address, and a
worker maps the log once and reads only the entries added since its last
task (``_broadcast.prune_received``).
"""

from __future__ import annotations

import collections
import os
import struct
from typing import Any, Deque, List, Optional, Set, Tuple

from .. import _forksafe
from .._numpy import np
from .._transport._mapping import array_from_ref
from .._transport._refs import SHARED, ArrayRef
from .._transport._shared_store import new_shared_array

#: Where a drop log is: (path, device, inode, size in bytes) of its shared file.
LogAddress = Tuple[str, int, int, int]


def mapping_of(data: np.ndarray) -> np.ndarray:
    """The mapping under a shared array (``_shared_store``'s): its file is deleted when this object is collected."""
    while not (isinstance(data, np.memmap) and getattr(data, "filename", None)) and isinstance(data.base, np.ndarray):
        data = data.base
    return data


#: Tokens a drop log holds: a worker that missed more drops than this between two tasks checks all its copies.
DROP_SLOTS = 256
_TOKEN_BYTES = 16  # secrets.token_hex(16)
_DROP_COUNT = struct.Struct("<Q")


class DropLog:
    """The tokens of the broadcasts whose file this process deleted, in a ring workers read.

    A shared array: a count of drops, then the last ``DROP_SLOTS`` tokens. The
    slot is written before the count is raised, and a reader that finds the
    count moved more than ``DROP_SLOTS`` past what it read last (the ring
    went round) checks every copy instead. One per process at a time, made
    by a broadcast when there is none, and let go of once every broadcast it
    logs has been dropped (its file goes; workers keep their own mappings,
    which already show every drop); a forked child makes its own.
    """

    def __init__(self) -> None:
        self.array = new_shared_array((_DROP_COUNT.size + DROP_SLOTS * _TOKEN_BYTES,), np.dtype(np.uint8), "C")
        # Tokens of this log's broadcasts whose file still exists. A set: add and discard are atomic, so a
        # finalizer running inside another thread's bookkeeping needs no lock for it.
        self.live: Set[str] = set()
        self._lock = _forksafe.lock()
        self._pending: Deque[str] = collections.deque()
        self._pid = os.getpid()
        # Sent as plain values, not as the array: a shared array would cost each task a route and a
        # mapping per broadcast it names, and a worker needs to map the log only once. None when
        # unknown: workers then check each copy's file before every task, as without a log.
        self.address: Optional[LogAddress] = None
        path = getattr(mapping_of(self.array), "filename", None)
        try:
            info = os.stat(path) if path else None
        except OSError:
            info = None
        if info is not None:
            self.address = (path, info.st_dev, info.st_ino, int(self.array.nbytes))

    def add(self, token: str) -> None:
        """Record a drop. Called by a finalizer: a collection may run it inside another ``add``, in the same thread."""
        if os.getpid() != self._pid:
            return  # a forked child's inherited finalizer: the parent still holds the broadcast
        self._pending.append(token)
        # Whoever holds the lock writes what is pending, this token included (it was
        # queued before the lock was tried); the holder looks again after releasing it.
        while self._pending:
            if not self._lock.acquire(blocking=False):
                return
            try:
                while self._pending:
                    token = self._pending.popleft()
                    self._write(token)
                    self.live.discard(token)
            finally:
                self._lock.release()
        if not self.live:
            _let_go_of_log(self)

    def _write(self, token: str) -> None:
        (count,) = _DROP_COUNT.unpack_from(self.array, 0)
        slot = _DROP_COUNT.size + (count % DROP_SLOTS) * _TOKEN_BYTES
        self.array[slot : slot + _TOKEN_BYTES] = np.frombuffer(bytes.fromhex(token), np.uint8)
        _DROP_COUNT.pack_into(self.array, 0, count + 1)  # after the slot: readers trust slots below the count


def map_log(address: Any) -> Optional[np.ndarray]:
    """A worker's own read-only mapping of a parent's drop log; None when it cannot be mapped (another machine)."""
    try:
        path, device, inode, size = address
        ref = ArrayRef(path, int(device), int(inode), SHARED, "r", 0, (int(size),), (1,), np.dtype(np.uint8))
        log = array_from_ref(ref, cached=False)
    except (OSError, ValueError, TypeError):
        return None
    return log if log.nbytes >= _DROP_COUNT.size + DROP_SLOTS * _TOKEN_BYTES else None


def read_drops(log: np.ndarray, since: int) -> Tuple[int, Optional[List[str]]]:
    """(count now, tokens dropped since the count ``since``), or the tokens None when the ring went round."""
    (count,) = _DROP_COUNT.unpack_from(log, 0)
    if count - since > DROP_SLOTS or count < since:
        return count, None
    tokens = []
    for index in range(since, count):
        slot = _DROP_COUNT.size + (index % DROP_SLOTS) * _TOKEN_BYTES
        tokens.append(bytes(log[slot : slot + _TOKEN_BYTES]).hex())
    # The parent may have written over the slots read meanwhile: then they prove nothing.
    (now,) = _DROP_COUNT.unpack_from(log, 0)
    return (count, tokens) if now - since <= DROP_SLOTS else (now, None)


# One log per process, shared by its live broadcasts (a worker maps each log once); None between
# broadcasts. A forked child starts with none (_after_fork_in_child).
_drops: Optional[DropLog] = None
_drops_lock = _forksafe.lock()


def drop_log(token: str) -> DropLog:
    """The process's drop log, made if there is none, now logging the broadcast ``token``."""
    global _drops
    with _drops_lock:
        if _drops is None:
            _drops = DropLog()
        _drops.live.add(token)
        return _drops


def _let_go_of_log(log: DropLog) -> None:
    """``log`` logs no live broadcast: the next broadcast makes a new one, and its file goes.

    Called from a finalizer, perhaps while this thread holds the lock inside
    ``drop_log``: it does not wait for the lock, and a log it cannot let go
    of now stays until its next drop or the process's end.
    """
    global _drops
    if not _drops_lock.acquire(blocking=False):
        return
    try:
        if _drops is log and not log.live:
            _drops = None
    finally:
        _drops_lock.release()


def _after_fork_in_child() -> None:
    global _drops
    _drops = None  # the parent's: this process's broadcasts get a log of their own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
