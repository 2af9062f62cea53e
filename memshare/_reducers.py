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
"""

from __future__ import annotations

import dataclasses
import io
import marshal
import mmap
import os
import pickle
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import cloudpickle
import numpy as np

from . import _handoff, _memfd
from ._folders import FolderPair, delete_file, unlink_quietly
from ._mapping import array_from_ref, map_file
from ._refs import RESULT, SHARED, ArrayRef
from ._release import can_release
from ._result_files import create_result_file, fill_result_file
from ._routes import HAND_OVER, REFERENCE, RESULT_FILE, copied_route, result_route
from ._shared_store import lookup_shared
from ._stats import REFERENCED, log_decision

#: A pickle reduction, as ``__reduce__`` returns it: (callable, arguments).
Reduction = Tuple[Callable[..., Any], tuple]


#: Extra reducers a user gives: exact type -> function returning ``(constructor, args)``, as ``copyreg`` takes.
Reducers = Mapping[type, Callable[[Any], Any]]


class _Pickler(cloudpickle.Pickler):
    def __init__(
        self,
        file: io.BytesIO,
        reduce_array: Callable[[np.ndarray], Optional[Reduction]],
        reducers: Optional[Reducers] = None,
    ) -> None:
        super().__init__(file, protocol=5)
        self._reduce_array = reduce_array
        self._reducers = reducers or {}

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
    ) -> None:
        super().__init__(file, reduce_array, reducers)
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
) -> bytes:
    """Pickle ``obj``; ``reduce_array`` may reduce each array, ``slot_of`` may put it in a slot instead.

    Each object whose exact type is in ``reducers`` goes to its reducer; arrays
    are memshare's business: a reducer given for ``np.ndarray`` is not used.
    """
    buffer = io.BytesIO()
    if slot_of is None:
        pickler = _Pickler(buffer, reduce_array, reducers)
    else:
        pickler = _SlotPickler(buffer, reduce_array, slot_of, reducers)
    pickler.dump(obj)
    return buffer.getvalue()


#: Where a result slot's array is: a file (a result file to adopt, or the
#: user's own mapping to view), or the array itself when no file had room.
Slot = Union[ArrayRef, np.ndarray]

#: In the parent: the descriptor a worker passed for the memfd of (device, inode), or None (see ``_handoff``).
Receive = Callable[[Tuple[int, int]], Optional[int]]


def unpack(stream: bytes, slots: Sequence[Slot] = (), receive: Optional[Receive] = None) -> Any:
    """Unpickle a payload; ``slots`` says where the arrays it names by slot number are.

    ``receive`` gives the descriptors of result memfds (see :func:`adopt_result`).
    """
    if not slots:
        return pickle.loads(stream)
    return _SlotUnpickler(io.BytesIO(stream), slots, receive).load()


class _SlotUnpickler(pickle.Unpickler):
    """Loads each slot once, however often the stream names it: the same array comes back as one object."""

    def __init__(self, file: io.BytesIO, slots: Sequence[Slot], receive: Optional[Receive]) -> None:
        super().__init__(file)
        self._slots = slots
        self._receive = receive
        self._loaded: Dict[int, np.ndarray] = {}

    def persistent_load(self, pid: Any) -> np.ndarray:
        if not isinstance(pid, int) or not 0 <= pid < len(self._slots):
            raise pickle.UnpicklingError(f"memshare: a result names slot {pid!r}, which the outcome does not have")
        if pid not in self._loaded:
            self._loaded[pid] = _load_slot(self._slots[pid], self._receive)
        return self._loaded[pid]


def _load_slot(where: Slot, receive: Optional[Receive]) -> np.ndarray:
    """In the parent: the array of a result slot."""
    if isinstance(where, np.ndarray):
        return where  # no file had room: it came by value
    if where.kind == RESULT:
        return adopt_result(where, receive)
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


def adopt_result(ref: ArrayRef, receive: Optional[Receive] = None) -> np.ndarray:
    """In the parent: map a worker's result file and delete its name at once.

    From then on the memory lives exactly as long as the returned array (the
    mapping is its base); nothing is left on disk whatever happens next. The
    array is a plain, writable ``np.ndarray``: the mapping is shared but no
    other process has the file any more. A memfd result comes as the
    descriptor the worker passed (``receive``), already checked against the
    reference's (device, inode); the worker closed its own.
    """
    if ref.kind != RESULT:
        raise PermissionError(f"memshare: {ref.path!r} is not a result file")
    if _memfd.is_memfd_path(ref.path):
        fd = receive((ref.device, ref.inode)) if receive is not None else None
        if fd is None:
            raise FileNotFoundError(f"memshare: the memory of a {ref.nbytes}-byte result never arrived from its worker")
        try:
            raw = mmap.mmap(fd, os.fstat(fd).st_size)  # shared, read-write: the worker closed its descriptor
        finally:
            os.close(fd)
        return np.ndarray(ref.shape, ref.dtype, buffer=raw, offset=ref.offset, strides=ref.strides)
    base = map_file(dataclasses.replace(ref, mode="r+"))
    unlink_quietly(ref.path)
    raw = base.base  # the mmap.mmap under the np.memmap: a plain ndarray over it is no memmap
    return np.ndarray(ref.shape, ref.dtype, buffer=raw, offset=ref.offset, strides=ref.strides)


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
    is returned; at most ``MEMFD_RESULTS_PER_TASK`` per task, so that a
    task returning thousands of arrays cannot run the worker, or the
    descriptors in flight, out of their limit (the rest are named files).
    """

    MEMFD_RESULTS_PER_TASK = 128

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
        self._memfd_results = 0

    def slot_of(self, array: np.ndarray) -> Optional[int]:
        """The slot ``array`` travels in, or None to pickle it in the stream."""
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
        if self.spec.inbox is None or self._memfd_results >= self.MEMFD_RESULTS_PER_TASK:
            return dataclasses.replace(folder, in_memory=False)
        self._memfd_results += 1
        return folder

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
        pending.reverse()  # pop() from the end, in the order they were pickled
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
        """Pass the parent the descriptors of every memfd in the slots, then close this worker's own.

        Call it after :meth:`write_pending`, before returning the outcome, so
        that they are queued at the parent when the outcome arrives. Raises
        OSError when the parent's inbox is gone: the caller then discards
        everything (:meth:`discard_written`).
        """
        ours = [s for s in self.slots if isinstance(s, ArrayRef) and s.path in self._written]
        memfds = [s for s in ours if _memfd.is_memfd_path(s.path)]
        if not memfds and not self._handed:
            return
        fds = [_memfd.duplicate(s.path) for s in memfds]
        try:
            identities = [(s.device, s.inode) for s in memfds]
            handed = [(fd, _identity(fd)) for fd in self._handed]
            _handoff.send(self.spec.inbox, self.spec.owner, list(zip(fds, identities)) + handed)
        finally:
            for fd in fds:
                os.close(fd)
        # Queued at the parent now: its copies keep the memory, ours can go.
        for ref in memfds:
            delete_file(ref.path)
            self._written.remove(ref.path)
        self._close_handed()

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
            if self.spec.inbox is None:
                return None
            if (ref.device, ref.inode) not in map(_identity, self._handed):  # two views of one array: one descriptor
                fd = os.open(ref.path, os.O_RDWR | os.O_CLOEXEC)  # a magic link: checked after opening
                if _identity(fd) != (ref.device, ref.inode) or _memfd.kind_of_descriptor(fd) != SHARED:
                    os.close(fd)
                    return None
                self._handed.append(fd)
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
        self.slots.clear()
        self._close_handed()
        for path in self._written:
            delete_file(path)
        self._written.clear()


def _identity(fd: int) -> Tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def by_value(array: np.ndarray) -> None:
    """An array policy that pickles every array in the stream, as numpy does."""
    return None


def pack_result(value: Any, policy: ResultPolicy, reducers: Optional[Reducers] = None) -> bytes:
    """Pickle a task's return value (or failure) with its large arrays in ``policy``'s slots."""
    return pack(value, by_value, policy.slot_of, reducers)


__all__ = [
    "Reducers",
    "input_reduction",
    "ResultPolicy",
    "ResultSpec",
    "adopt_result",
    "by_value",
    "pack",
    "pack_result",
    "unpack",
]
