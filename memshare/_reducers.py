"""The pickler of task payloads and results, which carries out each array's route both ways.

This module knows nothing of pools or executors. It turns any picklable
object into a payload in which every ``np.ndarray`` (nested
anywhere: in tuples, dicts, DataFrames, sparse matrices, estimators) was
handed to an *array policy* first, which carries out the route ``_routes``
chose for it:

* task arguments, in the parent: the session decides each array's route
  (see ``_routes``) and reduces arrays that live in a file to
  :func:`input_reduction`, which the worker maps on unpickling; the rest
  are pickled.
* :class:`ResultPolicy`, in a worker, for return values: views of the user's
  own file mappings come back as references to the same memory; other large
  arrays, including views of the call's temporary dumps, are written to a
  new result file that the parent adopts (see :func:`adopt_result`), after
  the value is pickled (see ``_result_files``). Each of these is stored
  outside the stream as a numbered *slot* (pickle's ``persistent_id``), and
  the outcome's slot table says where each slot's array ended up.

Payloads (plain ``bytes``) are pickled with cloudpickle (lambdas, functions of ``__main__``)
and pickle protocol 5.

Out-of-band buffers: protocol 5 lets objects offer their data as
``PickleBuffer`` s (pyarrow's buffers, so Arrow tables and Arrow-backed pandas
columns; any library that pickles out of band). Each one offered while
packing goes to the sender's *buffer reducer* (``reduce_buffer``), which
keeps it in the stream or stands for it with a placeholder: a dump's
``ArrayRef`` for task arguments (the session writes it once per call), a
slot number for results (``ResultPolicy`` writes it to a result file). The
payload is then an *envelope*: the placeholders, then the stream, which the
receiver unpickles with ``buffers=`` views of those mappings (:func:`unpack`),
with no copy: read-only for arguments (unless the call maps writable), as
pyarrow expects of immutable data. pandas' Arrow-backed arrays are pickled
through their chunked array as it is (:func:`_arrow_column_reduction`), not
through the new combined copy pandas would make for every task. A
``bytearray`` is written into the stream by the pickler itself and never
offered as a buffer: it stays in the stream, as does anything that does not
pickle out of band.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import marshal
import os
import pickle
import socket
import stat
import struct
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import cloudpickle
import numpy as np

try:
    import resource
except ImportError:  # not a Unix: no descriptor limit to read, and no memfds either
    resource = None  # type: ignore[assignment]

from . import _handoff, _memfd
from ._errors import SharedMemoryFullError
from ._folders import FolderPair, delete_file
from ._mapping import array_from_ref, map_descriptor
from ._refs import RESULT, SHARED, ArrayRef, data_address, file_identity, kind_of_path
from ._release import can_release
from ._result_files import create_result_file, fill_result_file
from ._routes import HAND_OVER, OUT_OF_BAND, REFERENCE, RESULT_FILE, buffer_route, copied_route, result_route
from ._shared_store import lookup_shared
from ._stats import REFERENCED, log_decision, logger

_COPY_BYTES = 8 * 1024**2  # block size when a result memfd is copied into a named file

#: A pickle reduction, as ``__reduce__`` returns it: (callable, arguments).
Reduction = Tuple[Callable[..., Any], tuple]


#: Extra reducers a user gives: exact type -> function returning ``(constructor, args)``, as ``copyreg`` takes.
Reducers = Mapping[type, Callable[[Any], Any]]

#: The sender's decision for one buffer pickle offers out of band: what stands
#: for it in the envelope (an ``ArrayRef`` or a slot number), or None to keep it in the stream.
ReduceBuffer = Callable[[pickle.PickleBuffer], Optional[Any]]

# A payload with out-of-band buffers starts with this, then the length of the
# pickled placeholders, the placeholders, and the stream. A pickle of
# protocol 2 or more starts with PROTO (0x80): no plain stream starts like this.
_ENVELOPE = b"memshare-buffers\x00"
_HEADER_LENGTH = struct.Struct("<Q")


class _Pickler(cloudpickle.Pickler):
    def __init__(
        self,
        file: io.BytesIO,
        reduce_array: Callable[[np.ndarray], Optional[Reduction]],
        reducers: Optional[Reducers] = None,
        buffer_callback: Optional[Callable[[pickle.PickleBuffer], bool]] = None,
    ) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self._reduce_array = reduce_array
        self._reducers = reducers or {}
        # Looked up once per pickling pass, not once per object: reducer_override runs for every object.
        self._arrow_array = _pandas_arrow_array_class() if buffer_callback is not None else None

    def reducer_override(self, obj: Any) -> Any:
        # Exact types only: other ndarray subclasses (masked arrays, matrices)
        # pickle their own way, through plain arrays that come back here.
        if type(obj) is np.ndarray or type(obj) is np.memmap:
            reduced = self._reduce_array(obj)
            if reduced is not None:
                return reduced
            if type(obj) is np.memmap:
                # A memmap that is not shared as a file must not be rebuilt as
                # a memmap without a file on the other side.
                return _plain_reduction(obj)
            return NotImplemented
        if type(obj) is types.CodeType:
            return _code_reduction(obj)
        custom = self._reducers.get(type(obj))
        if custom is not None:
            return custom(obj)
        if self._arrow_array is not None and isinstance(obj, self._arrow_array):
            arrow = _arrow_column_reduction(obj)
            if arrow is not None:
                return arrow
        return super().reducer_override(obj)


def _code_reduction(code: types.CodeType) -> Any:
    """The code of a function sent by value (one of ``__main__``, a lambda), with its file name kept.

    cloudpickle rebuilds such code with the file name ``<dynamic-code>``, so
    a worker's traceback would show neither the file nor the source line.
    ``marshal`` keeps every field of the code object (file name and line
    table included); it is specific to the Python version, and workers run
    the parent's interpreter.
    """
    try:
        return marshal.loads, (marshal.dumps(code),)
    except ValueError:  # a constant marshal cannot write: let cloudpickle do it
        return NotImplemented


def _pandas_arrow_array_class() -> Optional[type]:
    """pandas' ``ArrowExtensionArray`` when pandas is imported already (it is not imported here), else None."""
    pandas = sys.modules.get("pandas")
    return getattr(getattr(pandas, "arrays", None), "ArrowExtensionArray", None)


def _arrow_column_reduction(obj: Any) -> Optional[Reduction]:
    """A pandas Arrow-backed array (``string[pyarrow]``, pandas 3's default strings, ``ArrowDtype``) without a copy.

    pandas pickles these through ``__getstate__``, which combines the
    column's chunks into a new Arrow array: a full copy of the column, made
    anew every time it is pickled, so its buffers could be neither kept out
    of the stream once per call nor pickled without doubling the memory.
    This reduction is pandas' own state with the chunked array as it is;
    pandas' ``__setstate__`` takes it as it takes a combined one. Values,
    dtype and nulls are the same; only the chunk layout is the column's
    own rather than a single chunk. ``obj`` is an ``ArrowExtensionArray``;
    only classes that define that state are reduced so.
    """
    if not hasattr(type(obj), "__setstate__"):
        return None
    state = dict(obj.__dict__)
    if "_cache" in state:
        state["_cache"] = {}  # cached properties are recomputed, as pandas pickles them
    return _from_state, (type(obj), state)


def _from_state(cls: type, state: dict) -> Any:
    """The object of class ``cls`` rebuilt by its own ``__setstate__`` from ``state``."""
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


def _plain_reduction(array: np.ndarray) -> Reduction:
    return np.asarray(array).view(np.ndarray).__reduce_ex__(5)


class _SlotPickler(_Pickler):
    """A pickler that stores some arrays outside the stream, as slot numbers.

    ``persistent_id`` is pickle's hook for objects kept outside the stream:
    it runs before any other way of pickling an object, and what it returns
    is all the stream holds of it. The unpickler's ``persistent_load`` turns
    the number back into the array (see :func:`unpack`).
    """

    def __init__(
        self,
        file: io.BytesIO,
        reduce_array: Callable[[np.ndarray], Optional[Reduction]],
        slot_of: Callable[[np.ndarray], Optional[int]],
        reducers: Optional[Reducers] = None,
        buffer_callback: Optional[Callable[[pickle.PickleBuffer], bool]] = None,
    ) -> None:
        super().__init__(file, reduce_array, reducers, buffer_callback)
        self._slot_of = slot_of

    def persistent_id(self, obj: Any) -> Optional[int]:
        if type(obj) is np.ndarray or type(obj) is np.memmap:
            return self._slot_of(obj)
        return None


def pack(
    obj: Any,
    reduce_array: Callable[[np.ndarray], Optional[Reduction]],
    slot_of: Optional[Callable[[np.ndarray], Optional[int]]] = None,
    reducers: Optional[Reducers] = None,
    reduce_buffer: Optional[ReduceBuffer] = None,
) -> bytes:
    """Pickle ``obj``; ``reduce_array`` may reduce each array, ``slot_of`` may put it in a slot instead.

    Each object whose exact type is in ``reducers`` goes to its reducer; arrays
    are memshare's business: a reducer given for ``np.ndarray`` is not used.
    ``reduce_buffer`` may take each out-of-band buffer out of the stream (see
    the module's docstring); None keeps every buffer in the stream.
    """
    buffer = io.BytesIO()
    placeholders: List[Any] = []
    callback = None
    if reduce_buffer is not None:

        def callback(offered: pickle.PickleBuffer) -> bool:
            placeholder = reduce_buffer(offered)
            if placeholder is None:
                return True  # in the stream
            placeholders.append(placeholder)
            return False

    if slot_of is None:
        pickler = _Pickler(buffer, reduce_array, reducers, callback)
    else:
        pickler = _SlotPickler(buffer, reduce_array, slot_of, reducers, callback)
    pickler.dump(obj)
    if not placeholders:
        return buffer.getvalue()
    header = pickle.dumps(placeholders, protocol=5)
    return b"".join((_ENVELOPE, _HEADER_LENGTH.pack(len(header)), header, buffer.getbuffer()))


def _open_envelope(stream: bytes) -> Tuple[Optional[List[Any]], memoryview]:
    """(placeholders, stream) of a payload; placeholders None for a plain stream."""
    view = memoryview(stream)
    if not stream.startswith(_ENVELOPE):
        return None, view
    start = len(_ENVELOPE) + _HEADER_LENGTH.size
    (length,) = _HEADER_LENGTH.unpack_from(stream, len(_ENVELOPE))
    return pickle.loads(view[start : start + length]), view[start + length :]


#: Where a result slot's array is: a file (a result file to adopt, or the
#: user's own mapping to view), or the array itself when no file had room.
Slot = Union[ArrayRef, np.ndarray]

#: In the parent: the descriptor a worker passed for the memfd of (device, inode), or None (see ``_handoff``).
Receive = Callable[[Tuple[int, int]], Optional[int]]


def unpack(
    stream: bytes,
    slots: Sequence[Slot] = (),
    receive: Optional[Receive] = None,
    folder: Optional[FolderPair] = None,
) -> Any:
    """Unpickle a payload; ``slots`` says where the arrays it names by slot number are.

    ``receive`` gives the descriptors of result memfds, ``folder`` is the
    session's folder pair, the only place result files may be adopted from
    (see :func:`adopt_result`).

    The out-of-band buffers of an envelope are rebuilt over their mappings:
    a task argument's dump mapped through the worker's cache (read-only
    unless the call's mode says otherwise), a result's slot adopted like
    any result file. The buffers are views of those mappings, no copy; each
    keeps its mapping alive.
    """
    placeholders, body = _open_envelope(stream)
    if not slots and placeholders is None:
        return pickle.loads(stream)
    slot = _Slots(slots, receive, folder)
    buffers = None
    if placeholders is not None:
        buffers = [memoryview(_rebuild_input(p) if isinstance(p, ArrayRef) else slot(p)) for p in placeholders]
    return _SlotUnpickler(io.BytesIO(body), slot, buffers).load()


class _Slots:
    """The arrays of an outcome's slots, each loaded once however often it is named: one array, one object."""

    def __init__(self, slots: Sequence[Slot], receive: Optional[Receive], folder: Optional[FolderPair]) -> None:
        self._slots = slots
        self._receive = receive
        self._folder = folder
        self._loaded: Dict[int, np.ndarray] = {}

    def __call__(self, pid: Any) -> np.ndarray:
        if not isinstance(pid, int) or not 0 <= pid < len(self._slots):
            raise pickle.UnpicklingError(f"memshare: a result names slot {pid!r}, which the outcome does not have")
        if pid not in self._loaded:
            self._loaded[pid] = _load_slot(self._slots[pid], self._receive, self._folder)
        return self._loaded[pid]


class _SlotUnpickler(pickle.Unpickler):
    """Turns each slot number of the stream into its array, and reads out-of-band buffers from ``buffers``."""

    def __init__(self, file: io.BytesIO, slot: _Slots, buffers: Optional[List[memoryview]]) -> None:
        super().__init__(file, buffers=buffers)
        self._slot = slot

    def persistent_load(self, pid: Any) -> np.ndarray:
        return self._slot(pid)


def _load_slot(where: Slot, receive: Optional[Receive], folder: Optional[FolderPair]) -> np.ndarray:
    """In the parent: the array of a result slot."""
    if isinstance(where, np.ndarray):
        return where  # no file had room: it came by value
    if where.kind == RESULT:
        return adopt_result(where, receive, folder)
    return _rebuild_reference(where)


def _rebuild_input(ref: ArrayRef) -> np.memmap:
    """In a worker: the shared array, mapped through the process's cache."""
    return array_from_ref(ref, cached=True)


def _rebuild_reference(ref: ArrayRef) -> np.ndarray:
    """In the parent: a result that views the user's own file mapping."""
    shared = lookup_shared(ref)
    if shared is not None:
        return shared
    return array_from_ref(ref, cached=False)


def _owned_here(ref: ArrayRef) -> bool:
    """True when ``ref`` is a shared array that this process allocated."""
    return lookup_shared(ref) is not None


def adopt_result(ref: ArrayRef, receive: Optional[Receive] = None, folder: Optional[FolderPair] = None) -> np.ndarray:
    """In the parent: map a worker's result file and delete its name at once.

    From then on the memory lives exactly as long as the returned array (the
    mapping is its base); nothing is left on disk whatever happens next. The
    array is a plain, writable ``np.ndarray``: the mapping is shared but no
    other process has the file any more. The mapping keeps no descriptor
    (:func:`~memshare._mapping.map_descriptor`): a call may return any number
    of results under the process's descriptor limit.

    A memfd result comes as the descriptor the worker passed (``receive``),
    already checked against the reference's (device, inode); the worker
    closed its own. A named result file is adopted (mapped, then unlinked)
    only from ``folder``, the session's folder pair: an outcome naming a
    file anywhere else, another session's for one, raises
    ``PermissionError`` and leaves that file alone. ``folder`` None skips
    that check (for callers that made the outcome themselves).
    """
    if ref.kind != RESULT:
        raise PermissionError(f"memshare: {ref.path!r} is not a result file")
    if _memfd.is_memfd_path(ref.path):
        fd = receive((ref.device, ref.inode)) if receive is not None else None
        if fd is None:
            raise FileNotFoundError(f"memshare: the memory of a {ref.nbytes}-byte result never arrived from its worker")
        try:
            raw = map_descriptor(fd, os.fstat(fd).st_size, "r+")  # shared, read-write: the worker closed its own
        finally:
            os.close(fd)
    else:
        raw = _take_result_file(ref, folder)
    return np.ndarray(ref.shape, ref.dtype, buffer=raw, offset=ref.offset, strides=ref.strides)


def _take_result_file(ref: ArrayRef, folder: Optional[FolderPair]) -> np.ndarray:
    """Map the named result file of ``ref`` (checked to be in ``folder``) and delete its name.

    The directory is opened first and every later step goes through that
    descriptor (``dir_fd``): the directory checked is the one the file is
    opened and unlinked in, whatever happens to the path's components
    meanwhile. The file itself is opened with ``O_NOFOLLOW`` and must be the
    reference's (device, inode).
    """
    if kind_of_path(ref.path) != RESULT:
        raise PermissionError(f"memshare: refusing to adopt {ref.path!r}: not a memshare result file")
    directory, name = os.path.split(ref.path)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if folder is not None and not _is_session_folder(os.fstat(dir_fd), folder):
            raise PermissionError(
                f"memshare: refusing to adopt the result file {ref.path!r}: it is not in this call's folders "
                f"({', '.join(map(repr, folder.folders()))}), where its workers write their results. The outcome "
                "names another call's file (left alone): a worker sent a result it did not make"
            )
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or not ref.is_file(info):
                raise FileNotFoundError(f"memshare: {ref.path!r} was replaced since it was shared")
            raw = map_descriptor(fd, info.st_size, "r+")
        finally:
            os.close(fd)
        # The mapping keeps the memory: the name can go now. Only this file's
        # name, should another file have taken it meanwhile.
        try:
            if ref.is_file(os.stat(name, dir_fd=dir_fd, follow_symlinks=False)):
                os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass  # removed already (the session closed its folder)
    finally:
        os.close(dir_fd)
    return raw


def _is_session_folder(directory: os.stat_result, folder: FolderPair) -> bool:
    """True when ``directory`` (a stat result) is one of ``folder``'s folders: the primary or a disk fallback.

    Compared by (device, inode), not by path: a path can name a folder
    through a symbolic link or ``..``, and another folder can have a name
    that starts like this one's. A folder of another user at one of the
    pair's names (planted there, and so passed over by the workers) is not
    the session's.
    """
    if directory.st_uid != os.geteuid():
        return False
    for path in folder.folders():
        try:
            if file_identity(os.stat(path)) == file_identity(directory):
                return True
        except OSError:
            continue  # not made yet: no result can be in it
    return False


def input_reduction(ref: ArrayRef) -> Reduction:
    """How a task argument found in the file at ``ref`` is pickled: the worker maps it on unpickling."""
    return _rebuild_input, (ref,)


@dataclass(frozen=True)
class ResultSpec:
    """What a worker needs to send results back: where, and above which size."""

    folder: FolderPair
    max_nbytes: Optional[int]
    #: The address of the parent's inbox for result memfds (``_handoff``), and the parent's pid;
    #: None: results are named files.
    inbox: Optional[str] = None
    owner: int = 0


class ResultPolicy:
    """Worker side: how return values travel.

    Every large array of the return value, and every view of a file mapping,
    becomes a *slot*: the stream holds its number only, and :attr:`slots`
    says where its data is, once :meth:`write_pending` has run: a result
    file the parent adopts, the worker's own shared array handed over, the
    user's file mapping to view, or the array itself when no file had room.
    Small arrays are pickled in the stream.

    Large arrays are not written while the return value is pickled: each
    gets an empty file at once, and :meth:`write_pending` writes them once
    the pickler and the task's own variables are gone. By then memshare often
    holds the only reference to an array, and its memory can be freed as it
    is written (see ``_release``).

    Records the files it made, so that they can be removed if anything fails.

    Result memfds (when the spec has an inbox) are handed to the parent by
    :meth:`send_memfds`, after :meth:`write_pending` and before the outcome
    is returned. The connection to the parent's inbox is made, without
    waiting, before the first memfd: when the inbox cannot take it at once
    (its queue is full), the task's results are named files instead. At
    most ``MEMFD_RESULTS_PER_TASK`` per task are memfds, and no more than
    the process's descriptor limit leaves room for (``SPARE_DESCRIPTORS``
    kept free for the rest), so that a task returning thousands of arrays
    cannot run the worker, or the descriptors in flight, out of their limit
    (the rest are named files).
    """

    MEMFD_RESULTS_PER_TASK = 128
    #: Descriptors a task leaves free for everything but its memfds: named result files, the
    #: connection, the descriptors duplicated for one message (``SEND_BATCH``), the user's own.
    SPARE_DESCRIPTORS = 32
    #: Memfds passed per message: each is duplicated for its message only, then closed with its original.
    SEND_BATCH = 16

    def __init__(self, spec: ResultSpec) -> None:
        self.spec = spec
        self.slots: List[Optional[Slot]] = []  # None until the slot's file is written
        self._written: List[str] = []  # every file made, to remove on failure
        self._slot_by_id: Dict[int, int] = {}  # the same array twice is one slot
        # Arrays sent by reference or handed over, held while pickling so that
        # their id() cannot be reused by a temporary array of a __reduce__.
        self._held: List[np.ndarray] = []
        # (slot, reference, one-item list holding the array): the list is the only
        # reference memshare keeps, which _release.can_release relies on.
        self._pending: List[Tuple[int, ArrayRef, List[np.ndarray]]] = []
        # Shared arrays of this worker handed over as memfds: descriptors opened for sending.
        self._handed: List[int] = []
        self._memfd_results = 0  # memfds this task holds for the parent: results and handed-over arrays
        self._memfd_cap: Optional[int] = None  # how many it may hold, worked out at the first one
        # The connection to the parent's inbox, made at the first memfd; None before, or when unreachable.
        self._connection: Optional[socket.socket] = None
        self._unreachable = False
        # Out-of-band buffers of the return value, as byte arrays over their memory, by (address, size):
        # the same memory offered twice (two wrappers of one Arrow buffer) is one array, so one slot.
        self._buffer_arrays: Dict[Tuple[int, int], np.ndarray] = {}

    def slot_of(self, array: np.ndarray) -> Optional[int]:
        """The slot ``array`` travels in, or None to pickle it in the stream."""
        with _descriptor_limit_explained():
            return self._slot_of(array)

    def buffer_slot(self, buffer: pickle.PickleBuffer) -> Optional[int]:
        """The slot an out-of-band buffer of the return value travels in, or None to keep it in the stream.

        A large buffer becomes a byte array over its memory (no copy), which
        travels as any large result: written to a result file after the
        value is pickled, the array (and so the buffer's exporter) held
        until then. The parent rebuilds the object over its mapping.
        """
        view = memoryview(buffer)
        if buffer_route(view.nbytes, view.contiguous, self.spec.max_nbytes).kind != OUT_OF_BAND:
            return None
        raw = np.frombuffer(buffer.raw(), np.uint8)
        raw = self._buffer_arrays.setdefault((data_address(raw), raw.nbytes), raw)
        return self.slot_of(raw)

    def _slot_of(self, array: np.ndarray) -> Optional[int]:
        slot = self._slot_by_id.get(id(array))
        if slot is not None:
            return slot
        route = result_route(array, self.spec.max_nbytes, _owned_here)
        if route.kind == HAND_OVER:
            handed = self._hand_over(route.ref)
            if handed is not None:
                self._held.append(array)
                return self._new_slot(array, handed)
            route = copied_route(array, self.spec.max_nbytes)
        if route.kind == REFERENCE:
            log_decision(REFERENCED, array, route.ref.path)
            self._held.append(array)
            return self._new_slot(array, route.ref)
        if route.kind != RESULT_FILE:
            return None
        ref = create_result_file(self._result_folder(), array)
        self._written.append(ref.path)
        slot = self._new_slot(array, None)
        self._pending.append((slot, ref, [array]))
        return slot

    def _result_folder(self) -> FolderPair:
        """Where the next result file goes: a memfd while the parent can take it and the cap allows."""
        folder = self.spec.folder
        if not folder.in_memory:
            return folder
        if not self._room_for_memfd():
            return self._named_folder()
        self._memfd_results += 1
        return folder

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
        if self._connection is None and not self._unreachable and self.spec.inbox is not None:
            try:
                self._connection = _handoff.connect(self.spec.inbox, self.spec.owner)
            except OSError as exc:
                if not _parent_busy(exc):
                    raise
                self._unreachable = True
                logger.info("memshare: this task's results are named files: the parent's inbox is busy (%s)", exc)
        return self._connection

    def _new_slot(self, array: np.ndarray, where: Optional[Slot]) -> int:
        self.slots.append(where)
        slot = self._slot_by_id[id(array)] = len(self.slots) - 1
        return slot

    def write_pending(self) -> None:
        """Write the arrays of the pickled return value into their files.

        Call it after dropping every other reference to the return value.
        Each array is let go of as soon as it is written, so the next one
        is written with it already freed.
        """
        pending, self._pending = self._pending, []
        self._slot_by_id.clear()
        self._held.clear()
        self._buffer_arrays.clear()  # each is held by its pending entry until written, and no longer
        pending.reverse()  # pop() from the end, in the order they were pickled
        with _descriptor_limit_explained():
            self._write(pending)

    def _write(self, pending: List[Tuple[int, ArrayRef, List[np.ndarray]]]) -> None:
        while pending:
            slot, ref, box = pending.pop()
            release = can_release(box)  # before box[0] is read again: that read is one more reference
            folder = self.spec.folder if _memfd.is_memfd_path(ref.path) else self._named_folder()
            final = fill_result_file(folder, ref, box[0], release)
            box.clear()
            if isinstance(final, ArrayRef) and final.path != ref.path:
                self._written.append(final.path)  # it moved to a new file
            self.slots[slot] = final

    def _named_folder(self) -> FolderPair:
        return dataclasses.replace(self.spec.folder, in_memory=False)

    def send_memfds(self) -> None:
        """Pass the parent the descriptors of every memfd in the slots, closing this worker's own as it goes.

        Call it after :meth:`write_pending`, before returning the outcome, so
        that they are queued at the parent when the outcome arrives. They go
        ``SEND_BATCH`` at a time, each duplicated for its message only and
        closed with its original once queued, so that sending needs few
        descriptors beyond those the results hold. What the parent cannot
        take now (a send that timed out, too many descriptors in flight)
        becomes named result files (:meth:`_to_named_files`). Raises OSError
        when the parent's inbox is gone: the caller then discards everything
        (:meth:`discard_written`).
        """
        try:
            with _descriptor_limit_explained():
                self._send_memfds()
        finally:
            self._close_connection()

    def _send_memfds(self) -> None:
        results = [
            s.path
            for s in self.slots
            if isinstance(s, ArrayRef) and s.path in self._written and _memfd.is_memfd_path(s.path)
        ]
        if not results and not self._handed:
            return
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
                    _handoff.send_on(connection, [(fd, _identity(fd)) for fd in fds])
                finally:
                    for fd in fds:
                        os.close(fd)
                # Queued at the parent now: its copies keep the memory, ours can go.
                for path in batch:
                    delete_file(path)
                    self._written.remove(path)
                del results[: len(batch)]
            while self._handed:
                batch = self._handed[: self.SEND_BATCH]
                _handoff.send_on(connection, [(fd, _identity(fd)) for fd in batch])
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
            self._to_named_files(results)

    def _to_named_files(self, results: List[str]) -> None:
        """Copy the memfds not sent (``results``, and the shared arrays still held) into named result files.

        Each slot that named one then names its copy, or holds the array by
        value when no file has room for it (the parent warns about either).
        """
        for path in results:
            fd = _memfd.duplicate(path)
            try:
                self._copy_out(fd)
            finally:
                os.close(fd)
            delete_file(path)
            self._written.remove(path)
        while self._handed:
            self._copy_out(self._handed[0])
            os.close(self._handed.pop(0))

    def _copy_out(self, source: int) -> None:
        identity, size = _identity(source), os.fstat(source).st_size
        named: Union[Tuple[str, Tuple[int, int]], np.ndarray]
        try:
            path, fd = self._named_folder().create_file(size, RESULT, warn=False)  # the parent warns
        except SharedMemoryFullError:
            named = _read_all(source, size)
        else:
            self._written.append(path)
            try:
                _copy_file(source, fd, size)
                named = (path, _identity(fd))
            finally:
                os.close(fd)
        for index, slot in enumerate(self.slots):
            if not isinstance(slot, ArrayRef) or (slot.device, slot.inode) != identity:
                continue
            if isinstance(named, np.ndarray):
                self.slots[index] = np.ndarray(
                    slot.shape, slot.dtype, buffer=named, offset=slot.offset, strides=slot.strides
                )
            else:
                path, (device, inode) = named
                self.slots[index] = dataclasses.replace(slot, path=path, device=device, inode=inode)

    def _close_connection(self) -> None:
        if self._connection is not None:
            self._connection.close()  # the parent reads what was queued before the close
            self._connection = None

    def _close_handed(self) -> None:
        for fd in self._handed:
            os.close(fd)
        self._handed.clear()

    def _hand_over(self, ref: ArrayRef) -> Optional[ArrayRef]:
        """Give the parent a shared array this worker allocated, with no copy.

        A memfd is passed to the parent (see :meth:`send_memfds`). A named
        file gets a second name in the call's folder, which the parent
        adopts like any result file; the worker's own name goes when its
        array is garbage-collected. Both then map the same pages.
        """
        if _memfd.is_memfd_path(ref.path):
            # Two views of one array: one descriptor.
            if (ref.device, ref.inode) not in map(_identity, self._handed):
                if not self._room_for_memfd():
                    return None
                fd = os.open(ref.path, os.O_RDWR | os.O_CLOEXEC)  # a magic link: checked after opening
                if _identity(fd) != (ref.device, ref.inode) or _memfd.kind_of_descriptor(fd) != SHARED:
                    os.close(fd)
                    return None
                self._handed.append(fd)
                self._memfd_results += 1
            return dataclasses.replace(ref, kind=RESULT, mode="r+")
        path = self.spec.folder.link_file(ref.path, RESULT)
        if path is None:
            return None
        self._written.append(path)
        return dataclasses.replace(ref, path=path, kind=RESULT, mode="r+")

    def discard_written(self) -> None:
        """Remove every file made so far, written or not, and forget every slot."""
        self._pending.clear()
        self._slot_by_id.clear()
        self._held.clear()
        self._buffer_arrays.clear()
        self.slots.clear()
        self._close_handed()
        self._close_connection()
        for path in self._written:
            delete_file(path)
        self._written.clear()


def _identity(fd: int) -> Tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


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
        open_now = len(os.listdir("/proc/self/fd")) - 1  # listdir's own descriptor is gone again
    except OSError:
        return None
    return soft - open_now


@contextlib.contextmanager
def _descriptor_limit_explained() -> Iterator[None]:
    """Raise running out of descriptors as what it is, with the limit and the fix (not as "no room")."""
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


def by_value(array: np.ndarray) -> None:
    """An array policy that pickles every array in the stream, as numpy does."""
    return None


def pack_result(value: Any, policy: ResultPolicy, reducers: Optional[Reducers] = None) -> bytes:
    """Pickle a task's return value (or failure) with its large arrays and buffers in ``policy``'s slots."""
    reduce_buffer = policy.buffer_slot if policy.spec.max_nbytes is not None else None
    return pack(value, by_value, policy.slot_of, reducers, reduce_buffer)


__all__ = [
    "Reducers",
    "ReduceBuffer",
    "input_reduction",
    "ResultPolicy",
    "ResultSpec",
    "adopt_result",
    "by_value",
    "pack",
    "pack_result",
    "unpack",
]
