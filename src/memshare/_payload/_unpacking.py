"""The receiving side of payloads: unpickling with slots, buffers and objects, and the rebuilders of mapped arrays.

A worker unpacks a task's payload and a parent an outcome with
:func:`unpack`. Arrays that live in a file travel as :func:`input_reduction`
(or :func:`own_input_reduction` for a file of the sender's own): the
receiver maps the file through its cache on unpickling. A result's arrays are
numbered slots, loaded once each however often the stream names them.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import pickle
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

from .._numpy import np
from .._transport._mapping import array_from_ref
from .._transport._protocol import Slot
from .._transport._refs import ArrayRef
from ._envelope import Buffer, open_envelope
from ._view_reader import ViewReader

#: A pickle reduction, as ``__reduce__`` returns it: (callable, arguments).
Reduction = Tuple[Callable[..., Any], tuple]

#: In the parent: the array of one slot of an outcome (see ``_adopt``).
LoadSlot = Callable[[Slot], "np.ndarray"]


#: In a worker: the (device, inode) of each file the parent gave the task as its own and no worker writes.
Given = Set[Tuple[int, int]]


def unpack(
    stream: Buffer,
    slots: Sequence[Slot] = (),
    load_slot: Optional[LoadSlot] = None,
    loaded_objects: Optional[Dict[Any, Any]] = None,
    given: Optional[Given] = None,
) -> Any:
    """Unpickle a payload; ``slots`` says where the arrays it names by slot number are.

    ``load_slot`` turns a slot into its array (needed when ``slots`` is not
    empty); each slot is loaded once however often the stream names it.

    The out-of-band buffers of an envelope are rebuilt over their mappings:
    a task argument's dump mapped through the worker's cache (read-only
    unless the call's mode says otherwise), a result's slot loaded like any
    other. The buffers are views of those mappings, no copy; each keeps its
    mapping alive. The argument objects it names are unpickled from their
    dumps, each once per ``loaded_objects`` (one table per task, shared with
    the payloads of those objects). ``given``, in a worker, collects the
    files the parent sent as its own (see :func:`own_input_reduction`).
    """
    header, body = open_envelope(stream)
    if not slots and header is None and (given is None or (type(body) is bytes and _OWN_NAME not in body)):
        return pickle.loads(body)  # no file of the sender's own can be met: pickle names its rebuilder
    slot = _Slots(slots, load_slot)
    buffers, objects = None, None
    if header is not None:
        placeholders, object_placeholders = header
        # An argument's buffers are the session's own dumps (or kept buffers), like its arrays'.
        rebuild = _rebuild_input if given is None else functools.partial(_rebuild_given, given)
        buffers = [memoryview(rebuild(p) if isinstance(p, ArrayRef) else slot(p)) for p in placeholders]
        objects = _Objects(object_placeholders, {} if loaded_objects is None else loaded_objects)
    # A bytes body is shared by BytesIO; a view (a mapped dump) is read in place, not copied.
    file = io.BytesIO(body) if type(body) is bytes else ViewReader(body)
    if given is not None:
        return _GivenUnpickler(file, slot, buffers, objects, given).load()
    return _SlotUnpickler(file, slot, buffers, objects).load()


class _Slots:
    """The arrays of an outcome's slots, each loaded once however often it is named: one array, one object."""

    def __init__(self, slots: Sequence[Slot], load_slot: Optional[LoadSlot]) -> None:
        self._slots = slots
        self._load_slot = load_slot
        self._loaded: Dict[int, np.ndarray] = {}

    def __call__(self, pid: Any) -> np.ndarray:
        if not isinstance(pid, int) or not 0 <= pid < len(self._slots):
            raise pickle.UnpicklingError(f"memshare: a result names slot {pid!r}, which the outcome does not have")
        if pid not in self._loaded:
            if self._load_slot is None:
                raise ValueError("memshare: unpack was given slots and no load_slot to load them")
            self._loaded[pid] = self._load_slot(self._slots[pid])
        return self._loaded[pid]


class _Objects:
    """The argument objects a payload names, each unpickled once per task from its dump or its own payload.

    ``loaded`` is the task's, shared by the payloads of its objects (an
    object's payload may name another object): an object that the task's
    arguments reach from several places is one object in the worker, as
    pickle's memo makes it within one stream. Each task unpickles its own:
    a task that changes an argument object changes its own copy only. A
    placeholder is the ``ArrayRef`` of a dump (keyed by its path), or, in a
    task's own envelope only, the object's payload itself (keyed by its
    index there: two equal payloads are still two objects).
    """

    def __init__(self, placeholders: Sequence[Union[ArrayRef, bytes]], loaded: Dict[Any, Any]) -> None:
        self._placeholders = placeholders
        self._loaded = loaded  # dump path, or ("inline", index) -> the object unpickled from it in this task

    def __call__(self, index: int) -> Any:
        placeholder = self._placeholders[index]
        key = placeholder.path if isinstance(placeholder, ArrayRef) else ("inline", index)
        if key not in self._loaded:
            # The dump of the object's payload, mapped read-only through the worker's cache; or the payload.
            payload = _rebuild_input(placeholder) if isinstance(placeholder, ArrayRef) else placeholder
            # Not ``given``: the dumps an object's payload names are the object's (its dump keeps them), not
            # the task's, so the parent would not find them among the task's files.
            self._loaded[key] = unpack(payload, loaded_objects=self._loaded)
        return self._loaded[key]


class _SlotUnpickler(pickle.Unpickler):
    """Turns slot numbers and argument objects of the stream into their values; buffers come from ``buffers``."""

    def __init__(
        self,
        file: Union[io.BytesIO, ViewReader],
        slot: _Slots,
        buffers: Optional[List[memoryview]],
        objects: Optional[_Objects] = None,
    ) -> None:
        super().__init__(file, buffers=buffers)
        self._slot = slot
        self._objects = objects

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is tuple and self._objects is not None:
            return self._objects(pid[1])
        return self._slot(pid)


class _GivenUnpickler(_SlotUnpickler):
    """A worker's unpickler of a task: notes in ``given`` each file the parent sent as its own."""

    def __init__(
        self,
        file: Union[io.BytesIO, ViewReader],
        slot: _Slots,
        buffers: Optional[List[memoryview]],
        objects: Optional[_Objects],
        given: Given,
    ) -> None:
        super().__init__(file, slot, buffers, objects)
        self._given = given

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        if found is _rebuild_own:
            return functools.partial(_rebuild_given, self._given)
        return found


def _rebuild_input(ref: ArrayRef) -> np.memmap:
    """In a worker: the shared array, mapped through the process's cache."""
    return array_from_ref(ref, cached=True)


def _rebuild_own(ref: ArrayRef) -> np.memmap:
    """In a worker: an array in a file of the parent's own (see :func:`own_input_reduction`)."""
    return array_from_ref(ref, cached=True)


def _rebuild_given(given: Given, ref: ArrayRef) -> np.memmap:
    """:func:`_rebuild_own`, noting the file in ``given`` when no worker writes it (read-only, copy-on-write)."""
    if ref.mode in ("r", "c"):
        given.add((ref.device, ref.inode))
    return array_from_ref(ref, cached=True)


def input_reduction(ref: ArrayRef) -> Reduction:
    """How a task argument found in the file at ``ref`` is pickled: the worker maps it on unpickling."""
    return _rebuild_input, (ref,)


#: What a stream that rebuilds a file of the sender's own holds: the name of the rebuilder.
_OWN_NAME = _rebuild_own.__name__.encode()


def own_input_reduction(ref: ArrayRef) -> Reduction:
    """:func:`input_reduction` for a file of the sender's own (its dump, an array held once).

    The sender keeps such a file until the task's outcome is restored, so a
    result that views it can come back as that file (``_routes.INPUT_FILE``).
    """
    return _rebuild_own, (ref,)


def copy_on_write(reduced: Reduction) -> Reduction:
    """A tensor's reference mapped copy-on-write where the call maps read-only: torch cannot take read-only memory."""
    rebuild, args = reduced
    own = rebuild in (_rebuild_input, _rebuild_own)
    if own and len(args) == 1 and isinstance(args[0], ArrayRef) and args[0].mode == "r":
        return rebuild, (dataclasses.replace(args[0], mode="c"),)
    return reduced


__all__ = [
    "Given",
    "LoadSlot",
    "Reduction",
    "copy_on_write",
    "input_reduction",
    "own_input_reduction",
    "unpack",
]
