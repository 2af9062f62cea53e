"""A worker's result policy: the slot each large array of a return value travels in, and where its data ends up.

Every large array of the return value, and every view of a file mapping,
becomes a *slot*: the stream holds its number only, and
:attr:`ResultPolicy.slots` says where its data is once the task's results
are written and sent: a result file the parent adopts, the worker's own
shared array handed over, the user's file mapping to view, a file the
parent gave the task (a view of its argument: the parent maps that file
copy-on-write), or the array itself when no file had room. Small arrays are pickled in the stream.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import AbstractSet, Dict, List, Optional, Tuple

from .._lifetime._folders import FolderPair
from .._numpy import np
from .._payload._routes import (
    HAND_OVER,
    INPUT_FILE,
    OUT_OF_BAND,
    REFERENCE,
    RESULT_FILE,
    buffer_route,
    copied_route,
    result_route,
)
from .._stats import REFERENCED, RETURNED_INPUT, log_decision
from .._transport._identity import MemoryKey, memory_key
from .._transport._pages import copy_on_write_unwritten
from .._transport._protocol import ResultSpec, Slot
from .._transport._refs import ArrayRef
from .._transport._shared_store import lookup_shared
from ._handoff_worker import Moved, ResultHandover, descriptor_limit_explained
from ._result_files import MadeFiles, PendingResults, create_result_file


class ResultPolicy:
    """Worker side: the slot table of one task's return value, and the route of each array in it.

    Large arrays are not written while the return value is pickled: each
    gets an empty file at once, and :meth:`write_pending` writes them once
    the pickler and the task's own variables are gone. By then memshare often
    holds the only reference to an array, and its memory can be freed as it
    is written (see ``_release``). Result memfds (when the spec has an
    inbox) then go to the parent with :meth:`send_memfds` (see
    ``_handoff_worker``), before the outcome is returned. Every file made is
    recorded, so that :meth:`discard_written` can remove them all if
    anything fails.
    """

    def __init__(self, spec: ResultSpec, given: AbstractSet[Tuple[int, int]] = frozenset()) -> None:
        """``given``: the (device, inode) of the files the parent sent this task as its own, which no worker writes."""
        self.spec = spec
        self._given = given
        self.slots: List[Optional[Slot]] = []  # None until the slot's file is written
        self._slot_by_id: Dict[int, int] = {}  # the same array twice is one slot
        # Arrays sent by reference or handed over, held while pickling so that
        # their id() cannot be reused by a temporary array of a __reduce__.
        self._held: List[np.ndarray] = []
        # Out-of-band buffers of the return value, as byte arrays over their memory, by (address, size):
        # the same memory offered twice (two wrappers of one Arrow buffer) is one array, so one slot.
        self._buffer_arrays: Dict[MemoryKey, np.ndarray] = {}
        self._named = dataclasses.replace(spec.folder, in_memory=False)
        self._made = MadeFiles()  # every file made, to remove on failure
        self._pending = PendingResults(spec.folder, self._made)
        self._handover = ResultHandover(spec, self._made)

    def slot_of(self, array: np.ndarray) -> Optional[int]:
        """The slot ``array`` travels in, or None to pickle it in the stream."""
        with descriptor_limit_explained():
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
        raw = self._buffer_arrays.setdefault(memory_key(raw), raw)
        return self.slot_of(raw)

    def write_pending(self) -> None:
        """Write the arrays of the pickled return value into their files.

        Call it after dropping every other reference to the return value.
        Each array is let go of as soon as it is written, so the next one
        is written with it already freed.
        """
        self._slot_by_id.clear()
        self._held.clear()
        self._buffer_arrays.clear()  # each is held by its pending entry until written, and no longer
        with descriptor_limit_explained():
            self._pending.write(self.slots)

    def send_memfds(self) -> None:
        """Pass the parent the descriptors of every memfd in the slots, closing this worker's own as it goes.

        Call it after :meth:`write_pending`, before returning the outcome, so
        that they are queued at the parent when the outcome arrives. A slot
        whose memfd the parent could not take now then names its copy in a
        named result file, or holds the array by value when no file had room
        (the parent warns about either). Raises OSError when the parent's
        inbox is gone: the caller then discards everything
        (:meth:`discard_written`).
        """
        self._repoint(self._handover.send(self.slots))

    def discard_written(self) -> None:
        """Remove every file made so far, written or not, and forget every slot."""
        self._pending.clear()
        self._slot_by_id.clear()
        self._held.clear()
        self._buffer_arrays.clear()
        self.slots.clear()
        self._handover.close()
        self._made.delete_all()

    def _slot_of(self, array: np.ndarray) -> Optional[int]:
        slot = self._slot_by_id.get(id(array))
        if slot is not None:
            return slot
        route = result_route(array, self.spec.max_nbytes, _owned_here, self._was_given, copy_on_write_unwritten)
        if route.kind == HAND_OVER:
            handed = self._handover.hand_over(route.ref)
            if handed is not None:
                self._held.append(array)
                return self._new_slot(array, handed)
            route = copied_route(array, self.spec.max_nbytes)
        if route.kind == REFERENCE:
            log_decision(REFERENCED, array, route.ref.path)
            self._held.append(array)
            return self._new_slot(array, route.ref)
        if route.kind == INPUT_FILE:
            # The parent still holds the file: it keeps the task's files until the outcome is restored.
            log_decision(RETURNED_INPUT, array, route.ref.path)
            self._held.append(array)
            return self._new_slot(array, route.ref)
        if route.kind != RESULT_FILE:
            return None
        ref = create_result_file(self._result_folder(), array)
        self._made.add(ref.path)
        slot = self._new_slot(array, None)
        self._pending.add(slot, ref, array)
        return slot

    def _was_given(self, ref: ArrayRef) -> bool:
        return (ref.device, ref.inode) in self._given

    def _result_folder(self) -> FolderPair:
        """Where the next result file goes: a memfd while the parent can take it and the cap allows."""
        if not self.spec.folder.in_memory:
            return self.spec.folder
        return self.spec.folder if self._handover.take_memfd() else self._named

    def _new_slot(self, array: np.ndarray, where: Optional[Slot]) -> int:
        self.slots.append(where)
        slot = self._slot_by_id[id(array)] = len(self.slots) - 1
        return slot

    def _repoint(self, moved: Dict[Tuple[int, int], Moved]) -> None:
        """Make each slot that names a memfd in ``moved`` name where its memory went."""
        if not moved:
            return
        for index, slot in enumerate(self.slots):
            if not isinstance(slot, ArrayRef) or (slot.device, slot.inode) not in moved:
                continue
            named = moved[(slot.device, slot.inode)]
            if isinstance(named, np.ndarray):
                self.slots[index] = np.ndarray(
                    slot.shape, slot.dtype, buffer=named, offset=slot.offset, strides=slot.strides
                )
            else:
                path, (device, inode) = named
                self.slots[index] = dataclasses.replace(slot, path=path, device=device, inode=inode)


def _owned_here(ref: ArrayRef) -> bool:
    """True when ``ref`` is a shared array that this process allocated."""
    return lookup_shared(ref) is not None


__all__ = ["ResultPolicy"]
