"""The fast path of small tasks: calls and values the standard pickler pickles as memshare's pickler would.

A pool's small task (a function sent by name, plain arguments) and a small
return value hold nothing for memshare to route, so they skip the pass of
memshare's pickler, whose ``persistent_id`` and ``reducer_override`` run for
every object, and cost what the standard pool's cost.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from typing import Any, Dict, Optional

import cloudpickle

from ._main_values import PLAIN_TYPES, MainFunction


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


class _TooLarge(Exception):
    pass


class _Bounded:
    """A file that counts what is written to it and stops the pickler once ``limit`` bytes are reached.

    The pickler writes whole frames (64 KiB with protocol 5), so it stops at most a frame past the limit.
    """

    __slots__ = ("written", "_limit")

    def __init__(self, limit: int) -> None:
        self.written, self._limit = 0, limit

    def write(self, data: Any) -> int:
        self.written += len(data)
        if self.written >= self._limit:
            raise _TooLarge
        return len(data)


def plain_size_below(value: Any, limit: int) -> Optional[bool]:
    """Whether ``value``, made only of builtin containers and plain values, pickles to fewer than ``limit`` bytes;
    None when it holds anything else.

    The standard pickler measures such a value at C speed, with the size its
    stream would have in a task (memshare's pickler makes the same, see
    :func:`plain_stream`), and stops at the limit: a large list is not
    pickled whole to find it is large.
    """
    sink = _Bounded(limit)
    try:
        _PlainPickler(sink, protocol=5, buffer_callback=_refuse_buffer).dump(value)
    except _TooLarge:
        return False
    except Exception:  # _NotPlain, or anything the full pass will report properly
        return None
    return sink.written < limit


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


__all__ = ["plain_call", "plain_size_below", "plain_stream"]
