"""Tables keyed by what a live value is: its identity (an object), or its memory (a buffer).

``np.ndarray`` is unhashable, so neither a dict nor a ``WeakSet`` can key on
one. An :class:`IdentityTable` keys on ``id()`` and keeps a weak reference
beside each value to tell the same array from a later one given the same
``id()``. The entry leaves the table the moment its array is collected:
weak reference callbacks run before the memory, and so the ``id()``, can be
reused. A long session over many short-lived arrays never grows the table.

A buffer has no object to key by: each exporter wraps the same memory in a
new object every time it is pickled. It is keyed by its memory, a
:data:`MemoryKey`. Such a key means that memory only while the entry holds
it (an export, an array over it, or a live owner, as each store documents):
otherwise the memory could be freed and its address taken by other data.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Generic, Optional, Tuple, TypeVar

from .._numpy import np

Value = TypeVar("Value")

#: A buffer's memory: (address of its first byte, size in bytes).
MemoryKey = Tuple[int, int]


def memory_key(raw: np.ndarray) -> MemoryKey:
    """The :data:`MemoryKey` of the bytes of a contiguous array (a byte view of a buffer)."""
    return raw.__array_interface__["data"][0], raw.nbytes


class IdentityTable(Generic[Value]):
    """A value per live object, found by the object's identity."""

    def __init__(self) -> None:
        self._items: Dict[int, Tuple[weakref.ref, Value]] = {}

    def get(self, obj: object) -> Optional[Value]:
        """The value stored for ``obj`` itself, or None."""
        item = self._items.get(id(obj))
        if item is None or item[0]() is not obj:
            return None
        return item[1]

    def __contains__(self, obj: object) -> bool:
        item = self._items.get(id(obj))
        return item is not None and item[0]() is obj

    def add(self, obj: object, value: Value, on_collected: Optional[Callable[[Value], None]] = None) -> None:
        """Store ``value`` for ``obj``; ``on_collected(value)`` runs when ``obj`` is garbage-collected."""
        key = id(obj)

        def collected(ref: weakref.ref) -> None:
            item = self._items.get(key)
            if item is None or item[0] is not ref:
                return  # replaced already, or the table was cleared
            del self._items[key]
            if on_collected is not None:
                on_collected(item[1])

        self._items[key] = (weakref.ref(obj, collected), value)

    def remove(self, obj: object) -> None:
        """Drop the entry of ``obj`` (its callback will not run)."""
        if obj in self:
            del self._items[id(obj)]

    def clear(self) -> None:
        self._items.clear()
