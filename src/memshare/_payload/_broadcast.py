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
broadcast whose file it deleted in its drop log (``_drop_log``, a small
shared array whose address travels with every broadcast), and a worker reads only the
entries added since its last task (:func:`prune_received`). memshare's own
pickler sends a broadcast as its token and its file (:func:`sent_by_reference`):
a worker holding the copy maps nothing, whatever it holds. The snapshot is
the contract in every process: a forked child (a ``context="fork"`` pool's
worker) does not take the parent's own object for a broadcast it inherited.
"""

from __future__ import annotations

import functools
import os
import pickle
import secrets
import struct
import weakref
from typing import Any, Dict, Generic, List, NamedTuple, Optional, Tuple, TypeVar

import cloudpickle

from .. import _forksafe
from .._lifetime._file_lifetime import FileLifetime
from .._numpy import np
from .._transport._backing import find_backing, mapped_file
from .._transport._mapping import array_from_ref, forget_mapping
from .._transport._refs import ArrayRef, is_file
from .._transport._shared_store import new_shared_array
from ._drop_log import LogAddress, drop_log, map_log, mapping_of, read_drops

T = TypeVar("T")

_ALIGN = 64  # every buffer starts on a 64-byte boundary: NumPy and Arrow need aligned data
_COUNT = struct.Struct("<Q")
_SPAN = struct.Struct("<QQ")  # offset, length
#: A broadcast whose pickled data is at most this size travels in each task's stream too (see sent_by_reference).
INLINE_NBYTES = 4096


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

    __slots__ = ("_value", "_data", "_token", "_drops", "_file", "_sender", "__weakref__")

    def __init__(self, value: T, data: np.ndarray, token: str, drops: Optional[LogAddress] = None) -> None:
        self._value = value
        self._data = data
        self._token = token
        self._drops = drops  # where the parent's drop log is (see _drop_log)
        # (pid, reference to the data's file, the reduction) once memshare's pickler sent it: see sent_by_reference.
        self._file: Optional[Tuple[int, ArrayRef, Tuple[Any, ...]]] = None
        self._sender: Optional[int] = None  # the sender that sent it last (see sent_by_reference)

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
    drops = drop_log(token)
    # When the file goes (the last view of the data collected), workers are told.
    weakref.finalize(mapping_of(data), drops.add, token)
    shared = Broadcast(obj, data, token, drops.address)
    _sent.put(token, shared)
    return shared


def sent_by_reference(shared: Broadcast, sender: int = 0) -> Optional[Sent]:
    """How memshare's pickler sends ``shared`` to its workers: its token and its data's file, not the array.

    None when the data is not in a file. A worker holding its copy then maps
    nothing (:func:`_receive_file`), and the sender finds the file and builds
    the reduction once per process, not once per task. Data of at most
    ``INLINE_NBYTES`` also travels in the stream: a worker's first receipt
    then maps nothing either, where a mapping would cost a page and five
    system calls. ``sender`` (a number per sender, such as a session's) tells
    whether this is its first sending of ``shared`` since another sender's:
    so each broadcast is counted once per session with no weak reference to
    it (two sessions sending it in turn count it again).
    """
    pid, file, data = os.getpid(), shared._file, shared._data
    if file is None or file[0] != pid:  # a forked child names the file by its own descriptor
        ref = find_backing(data)
        if ref is None or ref.shape != (data.nbytes,) or ref.strides != (1,) or ref.dtype != np.uint8:
            return None
        # Plain values, not the ArrayRef: a worker holding the copy builds nothing to find it.
        where = (ref.path, ref.device, ref.inode, ref.kind, ref.mode, ref.offset, data.nbytes)
        inline = data.tobytes() if data.nbytes <= INLINE_NBYTES else None
        file = shared._file = (pid, ref, (_receive_file, (shared._token, where, shared._drops, inline)))
    first = shared._sender != sender
    shared._sender = sender
    return Sent(file[2], data, file[1], first)


class Sent(NamedTuple):
    """A broadcast as memshare's pickler sends it (see :func:`sent_by_reference`)."""

    reduction: Tuple[Any, ...]
    data: Any  # an array (see _numpy for why not np.ndarray): the task keeps it alive, the file goes with its last view
    ref: ArrayRef  # its file
    first: bool  # the first sending by this sender


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _load(data: np.ndarray) -> Any:
    """Unpickle a broadcast's object over ``data``, its buffers read-only views of it."""
    view = memoryview(data).cast("B").toreadonly()
    (count,) = _COUNT.unpack_from(view, 0)
    spans = [_SPAN.unpack_from(view, _COUNT.size + index * _SPAN.size) for index in range(count + 1)]
    (start, length), buffers = spans[0], [view[offset : offset + size] for offset, size in spans[1:]]
    return pickle.loads(view[start : start + length], buffers=buffers)


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


class _Copy(NamedTuple):
    """A worker's copy of a broadcast: current until its parent drops it (no reader is counted: a task
    reading it holds the object itself, and only the cache's reference goes)."""

    shared: Broadcast
    identity: Tuple[int, int]  # (device, inode) of the file its data maps
    lifetime: FileLifetime


class _Received:
    """The broadcasts this process unpickled, each kept until its parent's drop log names it.

    The cost before a task is the number of drops since the last one, not
    the number of copies held: every copy is checked (its shared file still
    there) only when a drop log went round since, or for copies whose
    parent sent no log (a broadcast pickled by an older memshare).
    """

    def __init__(self) -> None:
        self._lock = _forksafe.lock()
        # token -> this process's copy; a copy's lifetime deletes its entry, under _lock
        self._entries: Dict[str, _Copy] = {}
        # (device, inode) of a parent's drop log -> [the log, the count of drops read so far]
        self._logs: Dict[Tuple[Any, ...], List[Any]] = {}
        self._unlogged = False  # a copy kept without a drop log: check every copy before each task

    def get(self, token: str, data: np.ndarray, drops: Optional[LogAddress] = None) -> Broadcast:
        """The copy of a broadcast whose data came as an array (pickled by its ``__reduce__``)."""
        with self._lock:
            entry = self._entries.get(token)
        if entry is not None and entry.lifetime.path == getattr(data, "filename", None):
            # Held already (tokens are random: the same path is the same file); the mapping it came over not cached.
            forget_mapping(entry.lifetime.path, *entry.identity)
            return entry.shared
        # The file memshare mapped the data from (no system call), else whatever file backs it.
        backing = mapped_file(data) or find_backing(data)
        if backing is None:
            # By value (another pickler): nothing to key a copy's lifetime by, so none is kept.
            return Broadcast(_load(data), data, token)
        # The copy holds its data's mapping for as long as it is kept: the cache need
        # not, nor check its file before each task.
        forget_mapping(backing.path, backing.device, backing.inode)
        return self.keep(token, data, backing.path, (backing.device, backing.inode), drops)

    def keep(
        self, token: str, data: np.ndarray, path: str, identity: Tuple[int, int], drops: Optional[LogAddress]
    ) -> Broadcast:
        """This process's copy of the broadcast ``token`` in the file ``path``: unpickled from ``data`` unless held."""
        self._watch(drops)
        copy = self.held(token, path, identity)
        if copy is not None:
            return copy
        shared = Broadcast(_load(data), data, token)
        # Two threads of one worker may both unpickle a new broadcast; the first kept wins.
        with self._lock:
            entry = self._entries.get(token)
            if entry is None:
                entry = _Copy(shared, identity, FileLifetime(path, functools.partial(self._entries.pop, token, None)))
                self._entries[token] = entry
        return entry.shared

    def _watch(self, drops: Optional[LogAddress]) -> None:
        """Read the drop log at ``drops`` before each task from now on (mapped once); None: check every copy."""
        log_key = tuple(drops[1:3]) if drops is not None else None
        with self._lock:
            if log_key in self._logs:
                return
        log = map_log(drops) if drops is not None else None
        with self._lock:
            if log is None:
                self._unlogged = True
            elif log_key not in self._logs:
                # Drops before this one cannot name a broadcast a task is reading now.
                self._logs[log_key] = [log, read_drops(log, 0)[0]]

    def held(self, token: str, path: str, identity: Tuple[int, int]) -> Optional[Broadcast]:
        """This process's copy of the broadcast ``token`` whose data is the file ``path``, if it holds one."""
        with self._lock:
            entry = self._entries.get(token)
        if entry is not None and entry.lifetime.path == path and entry.identity == identity:
            return entry.shared
        return None

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
                    self._retire(token)
            check_all = check_all or self._unlogged
            entries = list(self._entries.items()) if check_all else []
        if not check_all:
            return
        gone = [token for token, entry in entries if not is_file(entry.lifetime.path, entry.identity)]
        with self._lock:
            for token in gone:
                self._retire(token)

    def _retire(self, token: str) -> None:
        """Under _lock: the copy ``token`` is no longer current, and its entry goes."""
        entry = self._entries.get(token)
        if entry is not None:
            entry.lifetime.retire()

    def tokens(self) -> List[str]:
        with self._lock:
            return list(self._entries)


# Per process, as the mapping cache is: a worker's copies serve every task it runs.
# A forked child keeps the copies it inherited (they are valid snapshots) but not
# the parent's own objects, nor its drop log (see _drop_log).
_sent = _Sent()
_received = _Received()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_sent.forget_after_fork)


def _receive(token: str, data: np.ndarray, drops: Optional[LogAddress] = None) -> Broadcast:
    """Unpickling a broadcast: the parent's own, or this worker's copy, made on first receipt."""
    own = _sent.get(token)
    if own is not None:
        return own
    _received.prune()
    return _received.get(token, data, drops)


def _receive_file(
    token: str, where: Tuple[Any, ...], drops: Optional[LogAddress], inline: Optional[bytes] = None
) -> Broadcast:
    """Unpickling a broadcast sent by :func:`sent_by_reference`: read only on a first receipt, from ``inline`` if
    given, else from its file, mapped for as long as the copy is kept.

    ``where`` is (path, device, inode, kind, mode, offset, size in bytes) of its data in its file. Copies
    are pruned before each task (``prune_received``), not here: the task holds this broadcast alive.
    """
    own = _sent.get(token)
    if own is not None:
        return own
    path, device, inode, kind, mode, offset, nbytes = where
    copy = _received.held(token, path, (device, inode))
    if copy is not None:
        return copy
    if inline is not None:
        data = np.frombuffer(inline, np.uint8)
    else:
        ref = ArrayRef(path, device, inode, kind, mode, offset, (nbytes,), (1,), np.dtype(np.uint8))
        data = array_from_ref(ref, cached=False)
    return _received.keep(token, data, path, (device, inode), drops)


def prune_received() -> None:
    """Let go of the broadcasts whose parent dropped them (a worker calls this before each task)."""
    _received.prune()


def received_tokens() -> List[str]:
    """The tokens of the broadcasts this process holds a copy of (for diagnostics and tests)."""
    return _received.tokens()
