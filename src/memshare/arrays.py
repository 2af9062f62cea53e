"""Arrays that live in shared memory from the start.

Automatic dumping copies an array into shared memory once per call (and, on
Linux, holds a large ordinary array once: see ``_held_once``). An array made by :func:`empty`, :func:`zeros`,
:func:`full` or :func:`share` has its memory in a shared file from the start:
passing it, or any view of it, to ``MemmappingPool`` or the ``"memshare"``
backend costs no dump and no copy, whatever its size and in any number of
calls, and workers receive it writable, so they can fill disjoint slices of
a shared output.

Lifetime: the file is deleted when the last array viewing it is garbage
collected (see ``_shared_store``). The arrays are plain
``np.ndarray`` objects and pickle by value anywhere else (to disk, to Dask).
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence, Tuple, Union

import numpy as np

from ._transport._dumping import file_order
from ._transport._refs import find_backing
from ._transport._shared_store import new_shared_array

ShapeLike = Union[int, Sequence[int]]


def _check_shape(shape: ShapeLike) -> Tuple[int, ...]:
    if isinstance(shape, numbers.Integral):
        shape = (int(shape),)
    if isinstance(shape, (str, bytes)):
        raise TypeError(f"shape={shape!r} must be an int or a sequence of ints")
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape={shape!r} must be an int or a sequence of ints") from None
    for extent in dims:
        if isinstance(extent, bool) or not isinstance(extent, numbers.Integral) or extent < 0:
            raise ValueError(f"shape={shape!r} must contain non-negative integers only")
    return tuple(int(e) for e in dims)


def _check_dtype(dtype: Any) -> np.dtype:
    try:
        dtype = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"dtype={dtype!r} is not a NumPy dtype: {exc}") from None
    if dtype.hasobject:
        raise TypeError(
            f"dtype={dtype} holds Python objects, which cannot live in shared memory; "
            "use a numeric, boolean, string or structured dtype without objects"
        )
    return dtype


def _check_order(order: str) -> str:
    if order not in ("C", "F"):
        raise ValueError(f"order={order!r} must be 'C' (row-major) or 'F' (column-major)")
    return order


def empty(shape: ShapeLike, dtype: Any = float, order: str = "C") -> np.ndarray:
    """A new array in shared memory. Its memory starts zeroed (a new memfd or tmpfs file)."""
    return new_shared_array(_check_shape(shape), _check_dtype(dtype), _check_order(order))


def zeros(shape: ShapeLike, dtype: Any = float, order: str = "C") -> np.ndarray:
    """A new array of zeros in shared memory."""
    return empty(shape, dtype, order)


def full(shape: ShapeLike, fill_value: Any, dtype: Any = None, order: str = "C") -> np.ndarray:
    """A new array in shared memory filled with ``fill_value``."""
    if dtype is None:
        dtype = np.array(fill_value).dtype
    array = empty(shape, dtype, order)
    array[...] = fill_value
    return array


def share(array: Any, order: str = "K") -> np.ndarray:
    """A copy of ``array`` in shared memory (written once, with ``write()``)."""
    source = np.asarray(array)
    _check_dtype(source.dtype)
    order = _check_order(file_order(source, order))
    # The source is written in that order, slab by slab when it is not
    # already contiguous that way: no full-size temporary copy.
    return new_shared_array(tuple(source.shape), source.dtype, order, source)


def is_shared(array: Any) -> bool:
    """True when ``array``'s memory can travel to workers by reference.

    That is: arrays made by this module, ``np.memmap`` arrays (not
    copy-on-write ones), arrays over a file ``mmap`` (not private ones), and views of any of these.
    """
    return isinstance(array, np.ndarray) and array.size > 0 and find_backing(array) is not None
