"""The pickler of task payloads and results: each array and out-of-band buffer goes through the sender's policy.

This module knows nothing of pools or executors. It turns any picklable
object into a payload in which every ``np.ndarray`` (nested
anywhere: in tuples, dicts, DataFrames, sparse matrices, estimators) was
handed to an *array policy* first, which carries out the route ``_routes``
chose for it:

* task arguments, in the parent: the session decides each array's route
  (see ``_routes``) and reduces arrays that live in a file to
  :func:`~._unpacking.input_reduction`, which the worker maps on unpickling; the rest
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
payload is then an *envelope* (``_envelope``): the placeholders, then the stream, which the
receiver unpickles with ``buffers=`` views of those mappings (``_unpacking.unpack``),
with no copy: read-only for arguments (unless the call maps writable), as
pyarrow expects of immutable data. pandas' Arrow-backed arrays are pickled
through their chunked array as it is (:func:`_arrow_column_reduction`), not
through the new combined copy pandas would make for every task. A
``bytearray`` is written into the stream by the pickler itself and never
offered as a buffer: it stays in the stream, as does anything that does not
pickle out of band.
"""

from __future__ import annotations

import io
import marshal
import pickle
import sys
import types
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import cloudpickle

from .._compat import pandas_array_state
from .._numpy import np, numpy_imported
from .._transport._protocol import ResultSpec
from .._transport._refs import ArrayRef
from ._broadcast import Broadcast
from ._envelope import seal
from ._polars import classes as polars_classes
from ._polars import reduction as polars_reduction
from ._torch import argument_array as torch_argument_array
from ._torch import reduction as torch_reduction
from ._torch import result_array as torch_result_array
from ._torch import tensor_class
from ._unpacking import Reduction, copy_on_write

#: Extra reducers a user gives: exact type -> function returning ``(constructor, args)``, as ``copyreg`` takes.
Reducers = Mapping[type, Callable[[Any], Any]]

#: The sender's decision for one buffer pickle offers out of band: what stands
#: for it in the envelope (an ``ArrayRef`` or a slot number), or None to keep it in the stream.
ReduceBuffer = Callable[[pickle.PickleBuffer], Optional[Any]]

#: The sender's reduction of a broadcast (``_broadcast.sent_by_reference``, noted
#: in the task's record), or None to pickle it as its own ``__reduce__`` says.
ReduceBroadcast = Callable[[Broadcast], Optional[Reduction]]


class _Pickler(cloudpickle.Pickler):
    def __init__(
        self,
        file: io.BytesIO,
        reduce_array: Callable[[np.ndarray], Optional[Reduction]],
        reducers: Optional[Reducers] = None,
        buffer_callback: Optional[Callable[[pickle.PickleBuffer], bool]] = None,
        on_arrow: Optional[Callable[[Any], None]] = None,
        reduce_broadcast: Optional[ReduceBroadcast] = None,
    ) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self._reduce_array = reduce_array
        self._reduce_broadcast = reduce_broadcast
        self._reducers = reducers or {}
        self._on_arrow = on_arrow
        self._arrow_owners = _arrow_owner_classes() if on_arrow is not None else ()
        # Looked up once per pickling pass, not once per object: reducer_override runs for every object.
        self._arrow_array = _pandas_arrow_array_class() if buffer_callback is not None else None
        self._polars = polars_classes() if buffer_callback is not None else ()  # through Arrow: see _polars
        self._tensor = tensor_class() if buffer_callback is not None else None  # as arrays: see _torch
        # No object is an array before numpy is imported: (None, None) until then, since no object's type is
        # None. An array made during the pass by a __reduce__ that imports numpy still reaches shared memory:
        # pickle offers its buffer out of band (buffer_callback).
        self._ndarray, self._memmap = (np.ndarray, np.memmap) if numpy_imported() else (None, None)
        # id -> array, of the arrays argument tensors travel as in this pass: mapped copy-on-write.
        self._tensor_arrays: Dict[int, np.ndarray] = {}

    def reducer_override(self, obj: Any) -> Any:
        # Exact types only: other ndarray subclasses (masked arrays, matrices)
        # pickle their own way, through plain arrays that come back here.
        if type(obj) is self._ndarray or type(obj) is self._memmap:
            reduced = self._reduce_array(obj)
            if reduced is not None:
                if self._tensor_arrays and self._tensor_arrays.get(id(obj)) is obj:
                    return copy_on_write(reduced)
                return reduced
            if type(obj) is self._memmap:
                # A memmap that is not shared as a file must not be rebuilt as
                # a memmap without a file on the other side.
                return _plain_reduction(obj)
            return NotImplemented
        if type(obj) is Broadcast:  # before the lookups below, which would all miss
            if self._reduce_broadcast is not None:
                reduced = self._reduce_broadcast(obj)
                if reduced is not None:
                    return reduced
            return obj.__reduce__()
        if type(obj) is ArrayRef:
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
        reduce_broadcast: Optional[ReduceBroadcast] = None,
    ) -> None:
        super().__init__(file, reduce_array, reducers, buffer_callback, on_arrow, reduce_broadcast)
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
    reduce_broadcast: Optional[ReduceBroadcast] = None,
) -> bytes:
    """Pickle ``obj``; ``reduce_array`` may reduce each array, ``slot_of`` may put it in a slot instead.

    Each object whose exact type is in ``reducers`` goes to its reducer; arrays
    are memshare's business: a reducer given for ``np.ndarray`` is not used.
    ``reduce_buffer`` may take each out-of-band buffer out of the stream (see
    the module's docstring); None keeps every buffer in the stream.
    ``objects`` are (object, placeholder) pairs of argument objects pickled
    on their own (see ``_session``): wherever the stream meets one of these
    objects, it names its placeholder instead (the ``ArrayRef`` of the dump of
    its payload), which ``_unpacking.unpack`` turns back into one object;
    ``on_object`` is told the index of each one met. ``on_arrow`` is told
    each Arrow object (array, chunked array, record batch, table) met, before
    its buffers are offered. ``reduce_broadcast`` may reduce each
    :class:`~._broadcast.Broadcast` met (see :data:`ReduceBroadcast`).
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
        pickler = _ObjectPickler(
            buffer, reduce_array, indices, reducers, callback, on_object, on_arrow, reduce_broadcast
        )
    else:
        pickler = _Pickler(buffer, reduce_array, reducers, callback, on_arrow, reduce_broadcast)
    pickler.dump(obj)
    if not placeholders and not objects:
        return buffer.getvalue()
    return seal(placeholders, [placeholder for _, placeholder in objects], buffer.getbuffer())


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
    "Reducers",
    "ReduceBroadcast",
    "ReduceBuffer",
    "ResultSlots",
    "by_value",
    "pack",
    "pack_result",
]
