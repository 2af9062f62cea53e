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
that finds the file gone (:func:`prune_received`), or when it exits.
"""

from __future__ import annotations

import pickle
import secrets
import struct
import weakref
from typing import Any, Dict, Generic, List, Optional, Tuple, TypeVar

import cloudpickle
import numpy as np

from . import _forksafe
from ._refs import find_backing, is_file
from ._shared_store import new_shared_array

T = TypeVar("T")

_ALIGN = 64  # every buffer starts on a 64-byte boundary: NumPy and Arrow need aligned data
_COUNT = struct.Struct("<Q")
_SPAN = struct.Struct("<QQ")  # offset, length


class Broadcast(Generic[T]):
    """A read-only object shared with workers: pickled once, unpickled once per worker.

    ``value`` is the object: the parent's own in the parent, a copy made
    once per worker in a worker. Tasks must treat it as read-only: buffers
    (NumPy arrays, Arrow columns) are read-only in workers, and a change to any
    other part stays in that worker's copy, seen by the later tasks it runs
    and by no other process.
    """

    __slots__ = ("_value", "_data", "_token", "__weakref__")

    def __init__(self, value: T, data: np.ndarray, token: str) -> None:
        self._value = value
        self._data = data
        self._token = token

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
        return (_receive, (self._token, self._data))

    def __repr__(self) -> str:
        return f"<memshare.Broadcast of {type(self._value).__name__}, {self.nbytes} bytes shared>"


def broadcast(obj: T) -> Broadcast[T]:
    """Share ``obj`` with every task that receives the returned :class:`Broadcast`.

    ``obj`` is pickled now, once (later changes to it in the parent are not
    seen by workers); tasks read it as ``b.value``. Use it for read-only data
    that many tasks need: a lookup table, a fitted model, a DataFrame with
    object columns.
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
    shared = Broadcast(obj, data, token)
    _sent.put(token, shared)
    return shared


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
    """The parent's broadcasts by token, weakly: a broadcast that comes back is the parent's own."""

    def __init__(self) -> None:
        self._lock = _forksafe.lock()
        self._by_token: weakref.WeakValueDictionary[str, Broadcast] = weakref.WeakValueDictionary()

    def put(self, token: str, shared: Broadcast) -> None:
        with self._lock:
            self._by_token[token] = shared

    def get(self, token: str) -> Optional[Broadcast]:
        with self._lock:
            return self._by_token.get(token)


class _Received:
    """The broadcasts this process unpickled, each kept while its shared file exists."""

    def __init__(self) -> None:
        self._lock = _forksafe.lock()
        # token -> (broadcast, path, (device, inode)) of the file its data maps
        self._entries: Dict[str, Tuple[Broadcast, str, Tuple[int, int]]] = {}

    def get(self, token: str, data: np.ndarray) -> Broadcast:
        backing = find_backing(data)
        if backing is None:
            # By value (another pickler): nothing to key a copy's lifetime by, so none is kept.
            return Broadcast(_load(data), data, token)
        with self._lock:
            entry = self._entries.get(token)
        if entry is not None and entry[2] == (backing.device, backing.inode):
            return entry[0]
        shared = Broadcast(_load(data), data, token)
        # Two threads of one worker may both unpickle a new broadcast; the first kept wins.
        with self._lock:
            entry = self._entries.setdefault(token, (shared, backing.path, (backing.device, backing.inode)))
        return entry[0]

    def prune(self) -> None:
        """Let go of the broadcasts whose shared file is gone: the parent dropped them."""
        with self._lock:
            entries = list(self._entries.items())
        if not entries:
            return
        gone = [token for token, (_, path, identity) in entries if not is_file(path, identity)]
        with self._lock:
            for token in gone:
                self._entries.pop(token, None)

    def tokens(self) -> List[str]:
        with self._lock:
            return list(self._entries)


# Per process, as the mapping cache is: a worker's copies serve every task it runs.
# A forked child keeps both tables as they are: the copies it inherited are valid,
# and its own broadcasts are its own.
_sent = _Sent()
_received = _Received()


def _receive(token: str, data: np.ndarray) -> Broadcast:
    """Unpickling a broadcast: the parent's own, or this worker's copy, made on first receipt."""
    own = _sent.get(token)
    if own is not None:
        return own
    _received.prune()
    return _received.get(token, data)


def prune_received() -> None:
    """Let go of the broadcasts whose parent dropped them (a worker calls this before each task)."""
    _received.prune()


def received_tokens() -> List[str]:
    """The tokens of the broadcasts this process holds a copy of (for diagnostics and tests)."""
    return _received.tokens()
