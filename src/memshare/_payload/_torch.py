"""CPU torch tensors sent as the NumPy arrays they share memory with, so that large ones travel by reference.

torch pickles a tensor by copying its whole storage into the stream, once
per task, and the receiver copies it again. A CPU tensor of a dtype NumPy
has is, byte for byte, a NumPy view of its storage (``Tensor.numpy()``
shares the memory), so it can take the road of an array: held once, dumped
once per call or sent as a reference, and rebuilt with
``torch.from_numpy`` over the receiver's mapping, with the tensor's dtype,
shape and strides. A result comes back through a result file as a tensor
over the parent's mapping; a task that returns its argument tensor, or a
view of it, unwritten, gives back the argument's own file, which the parent
maps copy-on-write (``_Received``, ``_routes.INPUT_FILE``): no copy. The
byte array of a storage (:func:`is_storage_bytes`) may be held once though
it does not own its memory (``_held_once`` asks): when its memory is a malloc
chunk of its own, as torch's allocator gives large tensors.

torch has no read-only tensors, and a write into a read-only mapping kills
the process: an argument tensor's file is therefore always mapped
copy-on-write (``_reducers`` turns the call's read-only mode into
copy-on-write for these arrays), so a task's writes stay its own.

Only what comes back as torch's pickle gives it: a tensor of exactly
``torch.Tensor`` (subclasses, ``nn.Parameter`` among them, pickle their own
state), on the CPU, strided, not requiring grad, not quantized, nested,
named, conjugated or negated (lazy bits), with no attributes of its own,
of a dtype NumPy has (not ``bfloat16``, ``complex32`` or the float8 types),
and of at least :data:`SMALL` bytes. Anything else is pickled by torch, as
before. Within one task, two tensors sharing a storage arrive as two
tensors over their own memory, as two views of one NumPy array do.

memshare never imports torch in the sender: only a tensor of a process that
imported torch is met. The receiver imports it, as torch's pickle would.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

from .. import _forksafe
from .._numpy import np
from .._transport._identity import IdentityTable
from .._transport._refs import data_address

#: Tensors below this many bytes (joblib's default ``max_nbytes``) are pickled by torch.
SMALL = 1 << 20

#: A pickle reduction: (callable, arguments).
Reduction = Tuple[Callable[..., Any], tuple]


def tensor_class() -> Optional[type]:
    """``torch.Tensor`` when torch is imported already (it is never imported here), else None."""
    torch = sys.modules.get("torch")
    found = getattr(torch, "Tensor", None)
    return found if isinstance(found, type) else None


def _numpy_dtype(tensor: Any) -> Optional[np.dtype]:
    """The NumPy dtype of ``tensor``'s elements, or None when NumPy has none (``bfloat16``...)."""
    try:
        return tensor.new_empty(0).numpy().dtype
    except Exception:  # torch's TypeError for a dtype NumPy lacks
        return None


def unfit_reason(tensor: Any) -> Optional[str]:
    """Why ``tensor`` is pickled by torch rather than sent as an array, or None when it can travel as one."""
    torch = sys.modules.get("torch")
    if torch is None or type(tensor) is not torch.Tensor:
        return "it is not exactly a torch.Tensor"
    if tensor.device.type != "cpu":
        return "it is not on the CPU"
    if tensor.layout != torch.strided or tensor.is_nested:
        return "it is not a strided tensor"
    if tensor.requires_grad:
        return "it requires grad"
    if tensor.is_quantized:
        return "it is quantized"
    if tensor.is_conj() or tensor.is_neg():
        return "its conjugate or negative bit is set"
    if any(name is not None for name in getattr(tensor, "names", None) or ()):  # torch without named tensors: none
        return "it has named dimensions"
    if tensor.__dict__:
        return "it has attributes of its own"
    if tensor.element_size() * tensor.numel() < SMALL:
        return "it is small"
    if _numpy_dtype(tensor) is None:
        return f"NumPy has no dtype {tensor.dtype}"
    return None


class _Views:
    """Each tensor's NumPy view, made once per tensor and kept while the tensor lives.

    Per process because a tensor is sent by any pool or call of the
    process, and the dump table and arrays held once key on the identity of
    the array: the same tensor must give the same array each time, or it
    would be written again for each task. Every view of one storage has one
    base, a byte array of the whole storage, so that the storage is dumped
    (or held once) once whichever of its tensors are sent. An entry goes
    when its tensor is collected; it does not keep the tensor alive (the
    base views the storage through a tensor of its own). Valid as it is in a
    forked child, whose memory is a copy.
    """

    def __init__(self) -> None:
        self._lock = _forksafe.lock()
        self._views: IdentityTable[Tuple[np.ndarray, int, int]] = IdentityTable()
        self._bases: Dict[Tuple[int, int], weakref.ref] = {}  # (address, nbytes) of a storage -> its byte array

    def of(self, tensor: Any) -> np.ndarray:
        """``tensor``'s view, remade when its storage moved (``resize_``) since the view was made."""
        storage = tensor.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            found = self._views.get(tensor)
            if found is not None and found[1:] == (address, nbytes) and _same_geometry(found[0], tensor):
                return found[0]
            view = _view(tensor, self._base(storage, address, nbytes))
            self._views.add(tensor, (view, address, nbytes))
            return view

    def _base(self, storage: Any, address: int, nbytes: int) -> np.ndarray:
        """The byte array of the storage at ``address``, made once while any view of it lives."""
        key = (address, nbytes)
        known = self._bases.get(key)
        base = known() if known is not None else None
        # A storage that moved leaves its old byte array on freed memory: never reused.
        if base is not None and base.base.untyped_storage().data_ptr() == address:
            return base
        torch = sys.modules["torch"]
        base = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()

        def collected(ref: weakref.ref) -> None:
            if self._bases.get(key) is ref:
                del self._bases[key]

        self._bases[key] = weakref.ref(base, collected)
        return base

    def is_base(self, array: np.ndarray) -> bool:
        """True when ``array`` is the byte array of a storage made by :meth:`_base`, alive."""
        with self._lock:
            known = self._bases.get((data_address(array), array.nbytes))
        return known is not None and known() is array


def _same_geometry(view: np.ndarray, tensor: Any) -> bool:
    itemsize = view.itemsize
    return (
        view.shape == tuple(tensor.shape)
        and view.strides == tuple(stride * itemsize for stride in tensor.stride())
        and view.__array_interface__["data"][0] == tensor.data_ptr()
    )


def _view(tensor: Any, base: np.ndarray) -> np.ndarray:
    """A NumPy view with ``tensor``'s geometry over ``base``, the byte array of its whole storage.

    The byte array is the view's base, so that a large view of a storage is
    dumped (or held) as the storage with the view in it, keeping its
    strides (see ``_routes``).
    """
    dtype = _numpy_dtype(tensor)
    itemsize = dtype.itemsize
    return np.ndarray(
        shape=tuple(tensor.shape),
        dtype=dtype,
        buffer=base,
        offset=tensor.storage_offset() * itemsize,
        strides=tuple(stride * itemsize for stride in tensor.stride()),
    )


# Per process: see _Views.
_views = _Views()


def is_storage_bytes(array: np.ndarray) -> bool:
    """True when ``array`` is the byte array of a live tensor's storage that an argument tensor travels over.

    Such an array may be held once though it does not own its memory: the
    storage lives at least as long as the array, and frees its memory with
    ``free()``. The array's file then goes when it is collected, while the
    memory may live on in the storage's other tensors: their pages keep
    mapping the deleted file, privately, and a later array over them is not
    held again (its memory is no longer anonymous) but dumped.
    """
    return _views.is_base(array)


def argument_array(tensor: Any) -> Optional[np.ndarray]:
    """The array an argument ``tensor`` travels as (the same array each time), or None: torch pickles it."""
    try:
        return None if unfit_reason(tensor) is not None else _views.of(tensor)
    except Exception:  # anything this torch does not answer as expected: torch pickles it, as before
        return None


class _Received:
    """The file mappings that received tensors were rebuilt over, by the address and size of their storage.

    A tensor made by :func:`from_array` over a mapping of a file (an
    argument's dump or held file, mapped copy-on-write) no longer names
    that mapping: ``Tensor.numpy()`` gives an array whose base is the
    tensor. A task that returns such a tensor, or a view of it, would then
    have its memory copied into a result file. This table gives the result
    back its mapping, so that it can come back as that file
    (``_routes.INPUT_FILE``) when no page of it was written.

    Per process because tensors are rebuilt by the unpickler, which knows
    no task or call. An entry goes when the array it names is collected,
    which is when the last tensor over it is (``torch.from_numpy`` keeps
    the array); it never keeps anything alive. Valid as it is in a forked
    child, whose mappings are the parent's, copied.
    """

    def __init__(self) -> None:
        self._lock = _forksafe.lock()
        self._arrays: Dict[Tuple[int, int], weakref.ref] = {}  # (address, nbytes) of a storage -> its array

    def note(self, tensor: Any, array: np.ndarray) -> None:
        """``tensor`` was made over ``array``, a view of a file mapping, by ``torch.from_numpy``."""
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())

        def collected(ref: weakref.ref) -> None:
            # No lock: a collection may run this while this thread holds it. A newer entry of the key stays.
            if self._arrays.get(key) is ref:
                self._arrays.pop(key, None)

        with self._lock:
            self._arrays[key] = weakref.ref(array, collected)

    def mapping_view(self, tensor: Any) -> Optional[np.ndarray]:
        """A NumPy view with ``tensor``'s geometry over the file mapping its storage was made over, or None."""
        storage = tensor.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            ref = self._arrays.get((address, nbytes))
        array = ref() if ref is not None else None
        if array is None:
            return None
        whole = _whole_mapping(array)
        if whole is None:
            return None
        start = whole.__array_interface__["data"][0]
        dtype = _numpy_dtype(tensor)
        itemsize = dtype.itemsize
        # The storage lies inside the mapping while the array lives: it is the array's own memory.
        if not (start <= address and address + nbytes <= start + whole.nbytes):
            return None
        return np.ndarray(
            shape=tuple(tensor.shape),
            dtype=dtype,
            buffer=whole,
            offset=tensor.data_ptr() - start,
            strides=tuple(stride * itemsize for stride in tensor.stride()),
        )


def _whole_mapping(array: np.ndarray) -> Optional[np.memmap]:
    """The outermost ``np.memmap`` of ``array``'s chain of bases, when it is contiguous: the whole mapping."""
    whole = None
    while isinstance(array, np.ndarray):
        if isinstance(array, np.memmap) and array.flags.c_contiguous:
            whole = array
        array = array.base
    return whole


# Per process: see _Received.
_received = _Received()


def result_array(tensor: Any) -> Optional[np.ndarray]:
    """The array a result ``tensor`` travels as, or None: torch pickles it.

    A tensor over a file mapping it was received with is a view of that
    mapping (see :class:`_Received`), so that its route can find the file;
    any other is ``Tensor.numpy()``.
    """
    try:
        if unfit_reason(tensor) is not None:
            return None
        view = _received.mapping_view(tensor)
        return view if view is not None else tensor.numpy()
    except Exception:  # as argument_array
        return None


def reduction(array: np.ndarray, strides: Tuple[int, ...]) -> Reduction:
    """How a tensor that travels as ``array`` is pickled; ``strides`` are its own, in elements."""
    return from_array, (array, strides)


def from_array(array: np.ndarray, strides: Tuple[int, ...]) -> Any:
    """The receiver's tensor over ``array``'s memory, with ``strides`` (in elements).

    ``array`` is writable: a copy-on-write mapping, a result's mapping, or
    pickled by value. A read-only one is copied rather than given to torch,
    which would crash on a write. An array that arrived in another layout
    (a small view dumped alone, written compactly) is copied into the
    tensor's own strides.
    """
    import torch  # the sender's objects were tensors: the receiver needs torch, as torch's own pickle would

    if not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    if tuple(tensor.stride()) != tuple(strides) and tensor.numel() > 1:
        strided = torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype)
        strided.copy_(tensor)
        return strided
    if isinstance(array, np.memmap):
        _received.note(tensor, array)  # returned, it may come back as its file: see _Received
    return tensor


__all__ = ["SMALL", "argument_array", "from_array", "reduction", "result_array", "tensor_class", "unfit_reason"]
