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

from ._numpy import np
from ._transport._backing import find_backing
from ._transport._dumping import file_order
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
    """A new array in shared memory. Its memory starts zeroed (a new memfd or tmpfs file).

    Passing it, or any view of it, to :class:`MemmappingPool` or the
    ``"memshare"`` backend costs no dump and no copy, and workers get it
    writable: their writes are visible here at once. The file is deleted
    when the last array viewing it is garbage-collected.

    Parameters
    ----------
    shape : int or sequence of int
        The array's shape; non-negative extents.
    dtype : data-type, optional
        Any NumPy dtype that holds no Python objects; float64 by default.
    order : {'C', 'F'}, optional
        Row-major (default) or column-major layout.

    Returns
    -------
    numpy.ndarray
        A plain, writable array whose memory is a shared file.

    Raises
    ------
    TypeError
        ``shape`` is not an int or a sequence of ints, or ``dtype`` is not a
        NumPy dtype or holds Python objects.
    ValueError
        ``shape`` has a negative extent, or ``order`` is neither ``'C'`` nor
        ``'F'``.
    SharedMemoryFullError
        No room for the file anywhere.

    See Also
    --------
    zeros, full, share, is_shared

    Examples
    --------
    >>> import memshare
    >>> out = memshare.empty((2, 3))
    >>> out.shape, memshare.is_shared(out)
    ((2, 3), True)
    """
    return new_shared_array(_check_shape(shape), _check_dtype(dtype), _check_order(order))


def zeros(shape: ShapeLike, dtype: Any = float, order: str = "C") -> np.ndarray:
    """A new array of zeros in shared memory.

    The same as :func:`empty`, whose memory starts zeroed.

    Parameters
    ----------
    shape : int or sequence of int
        The array's shape.
    dtype : data-type, optional
        Any NumPy dtype that holds no Python objects; float64 by default.
    order : {'C', 'F'}, optional
        Row-major (default) or column-major layout.

    Returns
    -------
    numpy.ndarray
        A writable array of zeros whose memory is a shared file.

    Raises
    ------
    TypeError, ValueError
        As :func:`empty`.

    Examples
    --------
    >>> import memshare
    >>> memshare.zeros(3).tolist()
    [0.0, 0.0, 0.0]
    """
    return empty(shape, dtype, order)


def full(shape: ShapeLike, fill_value: Any, dtype: Any = None, order: str = "C") -> np.ndarray:
    """A new array in shared memory filled with ``fill_value``.

    Parameters
    ----------
    shape : int or sequence of int
        The array's shape.
    fill_value : scalar
        The value of every element.
    dtype : data-type, optional
        By default, the dtype NumPy gives ``fill_value``.
    order : {'C', 'F'}, optional
        Row-major (default) or column-major layout.

    Returns
    -------
    numpy.ndarray
        A writable array whose memory is a shared file.

    Raises
    ------
    TypeError, ValueError
        As :func:`empty`.

    Examples
    --------
    >>> import memshare
    >>> memshare.full((2, 2), 7).tolist()
    [[7, 7], [7, 7]]
    """
    if dtype is None:
        dtype = np.array(fill_value).dtype
    array = empty(shape, dtype, order)
    array[...] = fill_value
    return array


def share(array: Any, order: str = "K") -> np.ndarray:
    """A copy of ``array`` in shared memory (written once, with ``write()``).

    For data reused over many calls: the copy then travels by reference at
    every call, with no dump and no comparison.

    Parameters
    ----------
    array : array_like
        The data to copy; anything ``numpy.asarray`` takes, without Python
        objects.
    order : {'K', 'C', 'F'}, optional
        The copy's layout: ``'K'`` (default) column-major for a
        Fortran-contiguous array, else row-major; ``'C'`` row-major;
        ``'F'`` column-major.

    Returns
    -------
    numpy.ndarray
        A writable copy whose memory is a shared file.

    Raises
    ------
    TypeError
        ``array``'s dtype holds Python objects.
    ValueError
        ``order`` is not one of ``'K'``, ``'C'``, ``'F'``.

    Examples
    --------
    >>> import numpy as np
    >>> import memshare
    >>> X = memshare.share(np.arange(4))
    >>> X.tolist(), memshare.is_shared(X)
    ([0, 1, 2, 3], True)
    """
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

    Parameters
    ----------
    array : object
        Anything; only a non-empty ``numpy.ndarray`` can be shared.

    Returns
    -------
    bool
        Whether passing ``array`` to memshare's workers costs no dump.

    Examples
    --------
    >>> import numpy as np
    >>> import memshare
    >>> memshare.is_shared(memshare.zeros(4)[1:]), memshare.is_shared(np.zeros(4))
    (True, False)
    """
    return isinstance(array, np.ndarray) and array.size > 0 and find_backing(array) is not None
