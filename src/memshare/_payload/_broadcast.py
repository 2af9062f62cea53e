"""Objects shared explicitly: pickled once in the parent, unpickled once per worker.

:func:`broadcast` pickles an object once into a shared array (its large
buffers, such as NumPy arrays and Arrow columns, out of band beside the
stream) and returns a :class:`Broadcast`. Passing the broadcast to tasks sends
only a reference to that array; each worker unpickles the object the first
time a task receives it and hands the same object to every later task it
runs, across calls, until the parent drops the broadcast. Large buffers are
rebuilt read-only over the shared mapping, so they exist once on the machine.

Lifetime: the shared array is deleted when the parent's broadcast is garbage
collected (see ``_shared_store``); a worker lets its copy go at its next task
after that, or when it exits. A worker may hold thousands of copies, so it
does not look at each before every task: the parent records the token of each
broadcast whose file it deleted in its drop log (:class:`_DropLog`, a small
shared array that travels with every broadcast), and a worker reads only the
entries added since its last task (:func:`prune_received`). The snapshot is
the contract in every process: a forked child (a ``context="fork"`` pool's
worker) does not take the parent's own object for a broadcast it inherited.
"""

from __future__ import annotations

import collections
import os
import pickle
import secrets
import struct
import weakref
from typing import Any, Deque, Dict, Generic, List, Optional, Set, Tuple, TypeVar

import cloudpickle
import numpy as np

from .. import _forksafe
from .._transport._backing import find_backing, mapped_file
from .._transport._mapping import array_from_ref, forget_mapping
from .._transport._refs import SHARED, ArrayRef, is_file
from .._transport._shared_store import new_shared_array

T = TypeVar("T")

_ALIGN = 64  # every buffer starts on a 64-byte boundary: NumPy and Arrow need aligned data
_COUNT = struct.Struct("<Q")
#: Where a drop log is: (path, device, inode, size in bytes) of its shared file.
LogAddress = Tuple[str, int, int, int]
_SPAN = struct.Struct("<QQ")  # offset, length


class Broadcast(Generic[T]):
    """A read-only object shared with workers: pickled once, unpickled once per worker.

    ``value`` is the object: the parent's own in the parent, a copy made
    once per worker in a worker. Tasks must treat it as read-only: buffers
    (NumPy arrays, Arrow columns) are read-only in workers, and a change to any
    other part stays in that worker's copy, seen by the later tasks it runs
    and by no other process.

    Made by :func:`broadcast`, not directly. Pass it to tasks instead of the
    object. It pickles by reference for memshare's workers, and by value for
    any other pickler (Dask, a file), so the same code runs there. Its shared
    memory is freed once the parent drops its last reference, and each worker
    lets its copy go at its next task.

    Attributes
    ----------
    value : object
        The shared object.
    nbytes : int
        The size of the pickled object in shared memory, buffers included.

    Examples
    --------
    >>> import memshare
    >>> b = memshare.broadcast([1, 2, 3])
    >>> b.value, b.nbytes > 0
    ([1, 2, 3], True)
    """

    __slots__ = ("_value", "_data", "_token", "_drops", "__weakref__")

    def __init__(self, value: T, data: np.ndarray, token: str, drops: Optional[LogAddress] = None) -> None:
        self._value = value
        self._data = data
        self._token = token
        self._drops = drops  # where the parent's drop log is (see _DropLog)

    @property
    def value(self) -> T:
        """The shared object."""
        return self._value

    @property
    def nbytes(self) -> int:
        """The size of the pickled object in shared memory, buffers included."""
        return int(self._data.nbytes)

    def __reduce__(self) -> Tuple[Any, ...]:
        # The data is a shared array: memshare's picklers send it by reference,
        # any other pickler (Dask, a file) by value, and the object still arrives.
        return (_receive, (self._token, self._data, self._drops))

    def __repr__(self) -> str:
        return f"<memshare.Broadcast of {type(self._value).__name__}, {self.nbytes} bytes shared>"


def broadcast(obj: T) -> Broadcast[T]:
    """Share ``obj`` with every task that receives the returned :class:`Broadcast`.

    ``obj`` is pickled now, once (later changes to it in the parent are not
    seen by workers); tasks read it as ``b.value``. Use it for read-only data
    that many tasks need: a lookup table, a fitted model, a DataFrame with
    object columns.

    Each worker unpickles the object the first time one of its tasks receives
    it, and hands the same object to every later task it runs, across calls.
    Arrays and Arrow buffers inside it are not unpickled: they are read-only
    views of the shared memory.

    Parameters
    ----------
    obj : object
        Anything cloudpickle can pickle.

    Returns
    -------
    Broadcast
        The handle to pass to tasks; ``b.value`` is ``obj`` in the parent.

    Raises
    ------
    pickle.PicklingError, TypeError
        ``obj`` cannot be pickled.
    SharedMemoryFullError
        No room for the pickled object.

    Examples
    --------
    >>> import memshare
    >>> table = memshare.broadcast({"a": 1, "b": 2})
    >>> def lookup(b, key):  # in a task: read b.value
    ...     return b.value[key]
    >>> memshare.Parallel(n_jobs=2)(memshare.delayed(lookup)(table, k) for k in "ab")
    [1, 2]
    """
    buffers: List[pickle.PickleBuffer] = []
    stream = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [buffer.raw() for buffer in buffers]
    spans, end = [], _aligned(_COUNT.size + _SPAN.size * (len(raws) + 1))
    for raw in [memoryview(stream), *raws]:
        spans.append((end, raw.nbytes))
        end = _aligned(end + raw.nbytes)
    data = new_shared_array((end,), np.dtype(np.uint8), "C")
    _COUNT.pack_into(data, 0, len(raws))
    for index, ((offset, length), raw) in enumerate(zip(spans, [memoryview(stream), *raws])):
        _SPAN.pack_into(data, _COUNT.size + index * _SPAN.size, offset, length)
        data[offset : offset + length] = np.frombuffer(raw, np.uint8)
    for buffer in buffers:
        buffer.release()
    token = secrets.token_hex(16)
    drops = _drop_log(token)
    # When the file goes (the last view of the data collected), workers are told.
    weakref.finalize(_mapping_of(data), drops.add, token)
    shared = Broadcast(obj, data, token, drops.address)
    _sent.put(token, shared)
    return shared


def _mapping_of(data: np.ndarray) -> np.ndarray:
    """The mapping under a shared array (``_shared_store``'s): its file is deleted when this object is collected."""
    while not (isinstance(data, np.memmap) and getattr(data, "filename", None)) and isinstance(data.base, np.ndarray):
        data = data.base
    return data


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _load(data: np.ndarray) -> Any:
    """Unpickle a broadcast's object over ``data``, its buffers read-only views of it."""
    view = memoryview(data).cast("B").toreadonly()
    (count,) = _COUNT.unpack_from(view, 0)
    spans = [_SPAN.unpack_from(view, _COUNT.size + index * _SPAN.size) for index in range(count + 1)]
    (start, length), buffers = spans[0], [view[offset : offset + size] for offset, size in spans[1:]]
    return pickle.loads(view[start : start + length], buffers=buffers)


#: Tokens a drop log holds: a worker that missed more drops than this between two tasks checks all its copies.
DROP_SLOTS = 256
_TOKEN_BYTES = 16  # secrets.token_hex(16)
_DROP_COUNT = struct.Struct("<Q")


class _DropLog:
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
        path = getattr(_mapping_of(self.array), "filename", None)
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


def _map_log(address: Any) -> Optional[np.ndarray]:
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


_drops: Optional[_DropLog] = None
_drops_lock = _forksafe.lock()


def _drop_log(token: str) -> _DropLog:
    """The process's drop log, made if there is none, now logging the broadcast ``token``."""
    global _drops
    with _drops_lock:
        if _drops is None:
            _drops = _DropLog()
        _drops.live.add(token)
        return _drops


def _let_go_of_log(log: _DropLog) -> None:
    """``log`` logs no live broadcast: the next broadcast makes a new one, and its file goes.

    Called from a finalizer, perhaps while this thread holds the lock inside
    ``_drop_log``: it does not wait for the lock, and a log it cannot let go
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


class _Sent:
    """The parent's broadcasts by token, weakly: a broadcast that comes back is the parent's own.

    Only in the process that made them: a forked child (a ``context="fork"``
    pool's worker) holds the parent's objects as they are now, perhaps
    changed since ``broadcast()``, and must unpickle the snapshot as a
    worker started any other way does.
    """

    def __init__(self) -> None:
        self._lock = _forksafe.lock()
        self._by_token: weakref.WeakValueDictionary[str, Broadcast] = weakref.WeakValueDictionary()

    def put(self, token: str, shared: Broadcast) -> None:
        with self._lock:
            self._by_token[token] = shared

    def get(self, token: str) -> Optional[Broadcast]:
        with self._lock:
            return self._by_token.get(token)

    def forget_after_fork(self) -> None:
        self._by_token = weakref.WeakValueDictionary()


class _Received:
    """The broadcasts this process unpickled, each kept until its parent's drop log names it.

    The cost before a task is the number of drops since the last one, not
    the number of copies held: every copy is checked (its shared file still
    there) only when a drop log went round since, or for copies whose
    parent sent no log (a broadcast pickled by an older memshare).
    """

    def __init__(self) -> None:
        self._lock = _forksafe.lock()
        # token -> (broadcast, path, (device, inode)) of the file its data maps
        self._entries: Dict[str, Tuple[Broadcast, str, Tuple[int, int]]] = {}
        # (device, inode) of a parent's drop log -> [the log, the count of drops read so far]
        self._logs: Dict[Tuple[Any, ...], List[Any]] = {}
        self._unlogged = False  # a copy kept without a drop log: check every copy before each task

    def get(self, token: str, data: np.ndarray, drops: Optional[LogAddress] = None) -> Broadcast:
        with self._lock:
            entry = self._entries.get(token)
        if entry is not None and entry[1] == getattr(data, "filename", None):
            # Held already (tokens are random: the same path is the same file): the cheap way, as
            # every later task naming it goes, with the mapping it came over not cached.
            forget_mapping(entry[1], *entry[2])
            return entry[0]
        # The file memshare mapped the data from (no system call), else whatever file backs it.
        backing = mapped_file(data) or find_backing(data)
        if backing is None:
            # By value (another pickler): nothing to key a copy's lifetime by, so none is kept.
            return Broadcast(_load(data), data, token)
        # The copy holds its data's mapping for as long as it is kept: the cache need
        # not, nor check its file before each task. Later receipts are views of that
        # mapping (the cache finds it while it lives), not new mappings.
        forget_mapping(backing.path, backing.device, backing.inode)
        log_key = tuple(drops[1:3]) if drops is not None else None
        with self._lock:
            entry = self._entries.get(token)
            known = log_key in self._logs
        if not known:
            log = _map_log(drops) if drops is not None else None
            with self._lock:
                if log is None:
                    self._unlogged = True
                elif log_key not in self._logs:
                    # Drops before this one cannot name a broadcast a task is reading now.
                    self._logs[log_key] = [log, read_drops(log, 0)[0]]
        if entry is not None and entry[2] == (backing.device, backing.inode):
            return entry[0]
        shared = Broadcast(_load(data), data, token)
        # Two threads of one worker may both unpickle a new broadcast; the first kept wins.
        with self._lock:
            entry = self._entries.setdefault(token, (shared, backing.path, (backing.device, backing.inode)))
        return entry[0]

    def prune(self) -> None:
        """Let go of the broadcasts their parents dropped since the last call."""
        check_all = False
        with self._lock:
            if not self._entries:
                return
            for state in self._logs.values():
                count, tokens = read_drops(state[0], state[1])
                state[1] = count
                if tokens is None:
                    check_all = True
                    continue
                for token in tokens:
                    self._entries.pop(token, None)
            check_all = check_all or self._unlogged
            entries = list(self._entries.items()) if check_all else []
        if not check_all:
            return
        gone = [token for token, (_, path, identity) in entries if not is_file(path, identity)]
        with self._lock:
            for token in gone:
                self._entries.pop(token, None)

    def tokens(self) -> List[str]:
        with self._lock:
            return list(self._entries)


# Per process, as the mapping cache is: a worker's copies serve every task it runs.
# A forked child keeps the copies it inherited (they are valid snapshots) but not
# the parent's own objects, nor its drop log (see _after_fork_in_child).
_sent = _Sent()
_received = _Received()


def _after_fork_in_child() -> None:
    global _drops
    _sent.forget_after_fork()
    _drops = None  # the parent's: this process's broadcasts get a log of their own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _receive(token: str, data: np.ndarray, drops: Optional[LogAddress] = None) -> Broadcast:
    """Unpickling a broadcast: the parent's own, or this worker's copy, made on first receipt."""
    own = _sent.get(token)
    if own is not None:
        return own
    _received.prune()
    return _received.get(token, data, drops)


def prune_received() -> None:
    """Let go of the broadcasts whose parent dropped them (a worker calls this before each task)."""
    _received.prune()


def received_tokens() -> List[str]:
    """The tokens of the broadcasts this process holds a copy of (for diagnostics and tests)."""
    return _received.tokens()
