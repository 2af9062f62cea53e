"""The pickler of task payloads and results: each array and out-of-band buffer goes through the sender's policy.

This module knows nothing of pools or executors. It turns any picklable
object into a payload in which every ``np.ndarray`` (nested
anywhere: in tuples, dicts, DataFrames, sparse matrices, estimators) was
handed to an *array policy* first, which carries out the route ``_routes``
chose for it:

* task arguments, in the parent: the session decides each array's route
  (see ``_routes``) and reduces arrays that live in a file to
  :func:`input_reduction`, which the worker maps on unpickling; the rest
  are pickled.
* a worker's result policy (``_result_policy``), for return values: views
  of the user's own file mappings come back as references to the same
  memory; other large arrays are written to result files after the value
  is pickled. Each of these is stored outside the stream as a numbered
  *slot* (pickle's ``persistent_id``), and the outcome's slot table says
  where each slot's array ended up; the parent loads each slot once as it
  unpickles (``_adopt``).

Payloads (plain ``bytes``) are pickled with cloudpickle (lambdas, functions of ``__main__``)
and pickle protocol 5.

Out-of-band buffers: protocol 5 lets objects offer their data as
``PickleBuffer`` s (pyarrow's buffers, so Arrow tables and Arrow-backed pandas
columns; any library that pickles out of band). Each one offered while
packing goes to the sender's *buffer reducer* (``reduce_buffer``), which
keeps it in the stream or stands for it with a placeholder: a dump's
``ArrayRef`` for task arguments (the session writes it once per call), a
slot number for results (the result policy writes it to a result file). The
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

import dataclasses
import functools
import io
import marshal
import pickle
import struct
import sys
import types
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Set, Tuple, Union

import cloudpickle
import numpy as np

from .._compat import pandas_array_state
from .._transport._mapping import array_from_ref
from .._transport._protocol import ResultSpec, Slot
from .._transport._refs import ArrayRef
from ._broadcast import Broadcast
from ._main_functions import PLAIN_TYPES, MainFunction
from ._polars import classes as polars_classes
from ._polars import reduction as polars_reduction
from ._torch import argument_array as torch_argument_array
from ._torch import reduction as torch_reduction
from ._torch import result_array as torch_result_array
from ._torch import tensor_class
from ._view_reader import ViewReader

#: Bytes of a payload: ``bytes``, or a view of a mapped file.
Buffer = Union[bytes, memoryview, np.ndarray]

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
        on_arrow: Optional[Callable[[Any], None]] = None,
    ) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self._reduce_array = reduce_array
        self._reducers = reducers or {}
        self._on_arrow = on_arrow
        self._arrow_owners = _arrow_owner_classes() if on_arrow is not None else ()
        # Looked up once per pickling pass, not once per object: reducer_override runs for every object.
        self._arrow_array = _pandas_arrow_array_class() if buffer_callback is not None else None
        self._polars = polars_classes() if buffer_callback is not None else ()  # through Arrow: see _polars
        self._tensor = tensor_class() if buffer_callback is not None else None  # as arrays: see _torch
        # id -> array, of the arrays argument tensors travel as in this pass: mapped copy-on-write.
        self._tensor_arrays: Dict[int, np.ndarray] = {}

    def reducer_override(self, obj: Any) -> Any:
        # Exact types only: other ndarray subclasses (masked arrays, matrices)
        # pickle their own way, through plain arrays that come back here.
        if type(obj) is np.ndarray or type(obj) is np.memmap:
            reduced = self._reduce_array(obj)
            if reduced is not None:
                if self._tensor_arrays and self._tensor_arrays.get(id(obj)) is obj:
                    return _copy_on_write(reduced)
                return reduced
            if type(obj) is np.memmap:
                # A memmap that is not shared as a file must not be rebuilt as
                # a memmap without a file on the other side.
                return _plain_reduction(obj)
            return NotImplemented
        if type(obj) is ArrayRef or type(obj) is Broadcast:  # before the lookups below, which would all miss
            return obj.__reduce__()
        if type(obj) is types.CodeType:
            return _code_reduction(obj)
        if self._arrow_owners and isinstance(obj, self._arrow_owners):
            self._on_arrow(obj)  # told before its buffers are offered; pickled as usual
        custom = self._reducers.get(type(obj))
        if custom is not None:
            return custom(obj)
        if self._arrow_array is not None and isinstance(obj, self._arrow_array):
            arrow = _arrow_column_reduction(obj)
            if arrow is not None:
                return arrow
        if type(obj) in self._polars:
            polars = polars_reduction(obj)
            if polars is not None:
                return polars
        if type(obj) is self._tensor:
            array = self._tensor_array(obj)
            if array is not None:
                return torch_reduction(array, tuple(obj.stride()))
        return super().reducer_override(obj)

    def _tensor_array(self, tensor: Any) -> Optional[np.ndarray]:
        """The array an argument tensor travels as (mapped copy-on-write), or None: torch pickles it."""
        array = torch_argument_array(tensor)
        if array is not None:
            self._tensor_arrays[id(array)] = array
        return array


def _copy_on_write(reduced: Reduction) -> Reduction:
    """A tensor's reference mapped copy-on-write where the call maps read-only: torch cannot take read-only memory."""
    rebuild, args = reduced
    own = rebuild in (_rebuild_input, _rebuild_own)
    if own and len(args) == 1 and isinstance(args[0], ArrayRef) and args[0].mode == "r":
        return rebuild, (dataclasses.replace(args[0], mode="c"),)
    return reduced


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


def _arrow_owner_classes() -> Tuple[type, ...]:
    """The Arrow classes whose objects hold their buffers, when pyarrow is imported already (else none)."""
    pyarrow = sys.modules.get("pyarrow")
    if pyarrow is None:
        return ()
    return (pyarrow.Array, pyarrow.ChunkedArray, pyarrow.RecordBatch, pyarrow.Table)


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
    return _from_state, (type(obj), pandas_array_state(obj))


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

    def _tensor_array(self, tensor: Any) -> Optional[np.ndarray]:
        """The array a result tensor travels as (its slot decides where it ends up), or None: torch pickles it."""
        return torch_result_array(tensor)


class _ObjectPickler(_Pickler):
    """A pickler that names each object of ``pack``'s ``objects`` by its index instead of pickling it."""

    def __init__(
        self,
        file: io.BytesIO,
        reduce_array: Callable[[np.ndarray], Optional[Reduction]],
        indices: Dict[int, int],
        reducers: Optional[Reducers] = None,
        buffer_callback: Optional[Callable[[pickle.PickleBuffer], bool]] = None,
        on_object: Optional[Callable[[int], None]] = None,
        on_arrow: Optional[Callable[[Any], None]] = None,
    ) -> None:
        super().__init__(file, reduce_array, reducers, buffer_callback, on_arrow)
        self._indices = indices
        self._on_object = on_object

    def persistent_id(self, obj: Any) -> Optional[Tuple[str, int]]:
        index = self._indices.get(id(obj))
        if index is None:
            return None
        if self._on_object is not None:
            self._on_object(index)
        return ("object", index)


def pack(
    obj: Any,
    reduce_array: Callable[[np.ndarray], Optional[Reduction]],
    slot_of: Optional[Callable[[np.ndarray], Optional[int]]] = None,
    reducers: Optional[Reducers] = None,
    reduce_buffer: Optional[ReduceBuffer] = None,
    objects: Sequence[Tuple[Any, Any]] = (),
    on_object: Optional[Callable[[int], None]] = None,
    on_arrow: Optional[Callable[[Any], None]] = None,
) -> bytes:
    """Pickle ``obj``; ``reduce_array`` may reduce each array, ``slot_of`` may put it in a slot instead.

    Each object whose exact type is in ``reducers`` goes to its reducer; arrays
    are memshare's business: a reducer given for ``np.ndarray`` is not used.
    ``reduce_buffer`` may take each out-of-band buffer out of the stream (see
    the module's docstring); None keeps every buffer in the stream.
    ``objects`` are (object, placeholder) pairs of argument objects pickled
    on their own (see ``_session``): wherever the stream meets one of these
    objects, it names its placeholder instead (the ``ArrayRef`` of the dump of
    its payload), which :func:`unpack` turns back into one object;
    ``on_object`` is told the index of each one met. ``on_arrow`` is told
    each Arrow object (array, chunked array, record batch, table) met, before
    its buffers are offered.
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

    if slot_of is not None:
        pickler: _Pickler = _SlotPickler(buffer, reduce_array, slot_of, reducers, callback)
    elif objects:
        indices = {id(o): i for i, (o, _) in enumerate(objects)}
        pickler = _ObjectPickler(buffer, reduce_array, indices, reducers, callback, on_object, on_arrow)
    else:
        pickler = _Pickler(buffer, reduce_array, reducers, callback, on_arrow)
    pickler.dump(obj)
    if not placeholders and not objects:
        return buffer.getvalue()
    header = pickle.dumps((placeholders, [placeholder for _, placeholder in objects]), protocol=5)
    return b"".join((_ENVELOPE, _HEADER_LENGTH.pack(len(header)), header, buffer.getbuffer()))


def plain_call(func: Any, args: tuple, kwargs: Dict[str, Any]) -> bool:
    """True when a call holds nothing for memshare's pickler to route: a function sent by name (one of
    ``__main__`` the workers have, see ``_main_functions``, or one of an importable module) with arguments of
    plain types only, whose stream the standard pickler makes alike.

    Without custom reducers (the caller checks), such a call is a small
    task of a pool, which then costs what the standard pool's costs.
    """
    if type(args) is not tuple or not (type(func) is MainFunction or _importable_by_name(func)):
        return False
    for arg in args:
        if type(arg) not in PLAIN_TYPES:
            return False
    return not kwargs or (type(kwargs) is dict and all(type(value) in PLAIN_TYPES for value in kwargs.values()))


def _importable_by_name(func: Any) -> bool:
    """True when cloudpickle, as the standard pickler, pickles ``func`` as a reference to its importable name.

    A plain function or a builtin function of a module, reached now from
    its module by its qualified name (checked at every call: a module
    attribute may be rebound), whose module is not one the user asked
    cloudpickle to send by value.
    """
    kind = type(func)
    if kind is types.BuiltinFunctionType:
        if not isinstance(getattr(func, "__self__", None), types.ModuleType):
            return False  # a bound method of an object: pickling it pickles the object
    elif kind is not types.FunctionType:
        return False
    module_name = getattr(func, "__module__", None)
    if not module_name or module_name == "__main__":
        return False
    by_value = cloudpickle.list_registry_pickle_by_value()
    if by_value and any(module_name == name or module_name.startswith(name + ".") for name in by_value):
        return False
    found: Any = sys.modules.get(module_name)
    for part in func.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is func


class _NotPlain(Exception):
    pass


class _PlainPickler(pickle.Pickler):
    """The standard pickler, stopped at the first object that is not a builtin container or a plain value.

    The pickler handles ``None``, booleans, ints, floats, strings, bytes,
    lists, tuples, dicts and sets itself, without asking ``reducer_override``:
    it is asked of every other object (an array, a class instance), and the
    buffer callback of every out-of-band buffer.
    """

    def reducer_override(self, obj: Any) -> Any:
        raise _NotPlain


def _refuse_buffer(buffer: pickle.PickleBuffer) -> bool:
    raise _NotPlain


def plain_stream(value: Any) -> Optional[bytes]:
    """``value`` pickled when it holds only builtin containers and plain values, for which the standard
    pickler makes the stream memshare's would; else None.

    No array or buffer is in it, and no reducer applies to it: the pickler
    asks none for these types (a ``complex`` goes through ``reducer_override``,
    so it is not plain here). A small task's return value then costs no
    result policy and no pass of memshare's pickler, whose ``persistent_id``
    runs for every object.
    """
    kind = type(value)
    if kind in PLAIN_TYPES and kind is not complex:
        return pickle.dumps(value, protocol=5)
    buffer = io.BytesIO()
    try:
        _PlainPickler(buffer, protocol=5, buffer_callback=_refuse_buffer).dump(value)
    except Exception:  # _NotPlain, or anything the full pass will report properly
        return None
    return buffer.getvalue()


def with_objects(payload: bytes, placeholders: Sequence[Any]) -> bytes:
    """``payload`` (packed with ``objects``) with the objects it names standing for ``placeholders`` instead.

    The stream names objects by index: only the envelope's list changes, so
    a payload measured with stand-ins can be sent without pickling it again.
    """
    header, body = _open_envelope(payload)
    if header is None:
        raise ValueError("memshare: this payload names no objects")
    buffers, _ = header
    header_bytes = pickle.dumps((buffers, list(placeholders)), protocol=5)
    return b"".join((_ENVELOPE, _HEADER_LENGTH.pack(len(header_bytes)), header_bytes, body))


def _open_envelope(stream: Buffer) -> Tuple[Optional[Tuple[List[Any], List[Any]]], Union[bytes, memoryview]]:
    """((buffer placeholders, object placeholders), stream) of a payload; None for a plain stream."""
    if type(stream) is bytes and not stream.startswith(_ENVELOPE):
        return None, stream  # most payloads: no view to make
    view = memoryview(stream).cast("B")
    if view[: len(_ENVELOPE)] != _ENVELOPE:
        return None, view
    start = len(_ENVELOPE) + _HEADER_LENGTH.size
    (length,) = _HEADER_LENGTH.unpack_from(view, len(_ENVELOPE))
    return pickle.loads(view[start : start + length]), view[start + length :]


#: In the parent: the array of one slot of an outcome (see ``_adopt``).
LoadSlot = Callable[[Slot], np.ndarray]


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
    header, body = _open_envelope(stream)
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


def by_value(array: np.ndarray) -> None:
    """An array policy that pickles every array in the stream, as numpy does."""
    return None


class ResultSlots(Protocol):
    """What :func:`pack_result` asks of a worker's result policy (``_result_policy.ResultPolicy``)."""

    spec: ResultSpec

    def slot_of(self, array: np.ndarray) -> Optional[int]: ...

    def buffer_slot(self, buffer: pickle.PickleBuffer) -> Optional[int]: ...


def pack_result(value: Any, policy: ResultSlots, reducers: Optional[Reducers] = None) -> bytes:
    """Pickle a task's return value (or failure) with its large arrays and buffers in ``policy``'s slots."""
    reduce_buffer = policy.buffer_slot if policy.spec.max_nbytes is not None else None
    return pack(value, by_value, policy.slot_of, reducers, reduce_buffer)


__all__ = [
    "LoadSlot",
    "Reducers",
    "ReduceBuffer",
    "Reduction",
    "ResultSlots",
    "Given",
    "by_value",
    "input_reduction",
    "own_input_reduction",
    "pack",
    "pack_result",
    "plain_call",
    "plain_stream",
    "unpack",
    "with_objects",
]
