"""numpy's and pandas' private names: which allocator made an array, a memmap's owner, an Arrow column's state."""

from __future__ import annotations

import functools
import sys
from typing import Any, Dict

from .._numpy import np


@functools.cache
def numpy_multiarray() -> Any:
    """numpy's ``multiarray`` module, which numpy 2 moved (imports numpy)."""
    try:  # numpy >= 2
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray
    return multiarray


@functools.cache
def numpy_pluggable_allocator() -> bool:
    """False before numpy 1.22, whose one allocator is malloc; later releases let a library plug its own."""
    return tuple(int(part) for part in np.__version__.split(".")[:2]) >= (1, 22)


def made_by_default_allocator(array: np.ndarray) -> bool:
    """True when ``array`` owns memory that NumPy's default allocator (malloc) gave it.

    Before numpy 1.22 every array that owns its data got it from malloc. The
    handler's name is what NEP 49 documents for telling allocators apart; numpy
    2 moved the module that exposes it.
    """
    if not array.flags.owndata:
        return False
    if not numpy_pluggable_allocator():
        return True
    get_handler_name = getattr(numpy_multiarray(), "get_handler_name", None)
    return get_handler_name is not None and get_handler_name(array) == "default_allocator"


def set_memmap_owner(array: np.memmap, owner: Any) -> None:
    """Give ``array`` the object owning its mapping as numpy's ``np.memmap.__new__`` does (``_mmap``).

    numpy turns a slice of a memmap whose ``_mmap`` is None into a plain
    ndarray, and copies ``_mmap`` to every view; an ``np.memmap`` that memshare
    builds over a mapping that keeps no descriptor must carry it for its
    slices to stay memmaps. Setting it is harmless where numpy stops using it.
    """
    array._mmap = owner


def gil_enabled() -> bool:
    """False on a free-threaded CPython running without its GIL (3.13+); True everywhere else."""
    is_gil_enabled = getattr(sys, "_is_gil_enabled", None)
    return True if is_gil_enabled is None else bool(is_gil_enabled())


# -- pandas --------------------------------------------------------------------


def pandas_array_state(array: Any) -> Dict[str, Any]:
    """The state pandas pickles an Arrow-backed array with, minus the copy: its ``__dict__``, cached properties emptied.

    pandas' ``__getstate__`` also combines the column's chunks into a new
    Arrow array, which is what memshare avoids; its cached properties live in
    ``_cache``, which it empties (they are recomputed). pandas is optional and
    is not imported to check this at import: ``tests/test_compat.py`` compares
    this state with pandas' own where pandas is installed.
    """
    state = dict(array.__dict__)
    if "_cache" in state:
        state["_cache"] = {}
    return state
