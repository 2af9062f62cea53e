"""Functions of ``__main__`` that a pool's workers have already, sent by name instead of by value.

Under forkserver and spawn, every worker runs the parent's main script as
``__mp_main__`` (its ``__main__`` there) when it starts, so the top-level
``def`` statements of that file exist in each worker before its first task.
The standard pool sends such a function by name; memshare pickles with
cloudpickle, which sends every function of ``__main__`` by value: its code,
and a copy of each global it reads. That made a small task cost several
times what it costs the standard pool, on both ends.

A function goes by name only where the worker's own function is certain to
behave as the parent's copy would. :class:`MainFunctions` decides once per
function and checks the decision again before each task at the cost of a few
identity tests; anything it is not certain of goes by value, as before:

* the workers import the main script: start method forkserver or spawn, and
  ``__main__`` has a real file (not ``python -c``, standard input, a notebook,
  ``python -m package`` whose ``__main__`` the workers do not re-run);
* the function is bound by an undecorated top-level ``def`` of that file, and
  its name by nothing else in the file (nothing under the main guard, no
  ``global`` statement, no other assignment or import), and the parent's
  ``__main__`` still binds the name to it; its code equals the code compiled
  from the file now (an edited file sends by value), it has no attributes of
  its own and no default that is not a literal equal to the file's;
* every global it reads is a builtin the file never binds, a module or an
  importable class or function bound once by a top-level ``import``, a
  literal constant bound once by a top-level assignment whose value in the
  parent still equals the file's, or another function that goes by name by
  these rules; and it assigns no global. So a global the parent changed
  before the call (a value set under the main guard) never turns into the
  worker's own different value.

The file is read and compiled once per process and path, while it keeps its
size and modification time (checked once per pool, when it starts). A file
edited after the workers started (a replacement worker then runs the new
code) is as with the standard pool.

Under fork, a worker's ``__main__`` is the parent's as it was when the pool
started its workers, file or not. The pool keeps a snapshot of it then
(each name's object, each function's code and defaults), and a function
goes by name when it and every global it reads are still those objects,
each global an immutable value, a module, an importable class or function,
or a function that goes by name by this rule; it assigns no global.
"""

from __future__ import annotations

import sys
import threading
import types
import weakref
from typing import Any, Dict, List, Optional, Set, Union

from ._main_script import Script, script_of_main
from ._main_values import (
    DYNAMIC_BUILTINS,
    MISSING,
    Decision,
    Function,
    decision,
    globals_of,
    imported_by_reference,
    plain_def,
    same_literal,
)

#: Start methods whose workers run the parent's main script when they start.
_IMPORTING_METHODS = ("forkserver", "spawn")


class MainFunctions:
    """For one pool: which functions of ``__main__`` its workers have, each decided once. Thread-safe."""

    def __init__(self, start_method: str) -> None:
        """Call it before the pool starts its workers: under fork, they get ``__main__`` as it is now."""
        self._script: Optional[Union[Script, _Forked]] = None
        if start_method in _IMPORTING_METHODS:
            self._script = script_of_main()
        elif start_method == "fork":
            self._script = _Forked.of_main()
        # id(function) -> its decision to go by name, which holds the function (so the id names no other):
        # top-level functions of __main__, which live as long as it. Functions that go by value (lambdas,
        # closures, made anew for each call) are held weakly, to be forgotten with them.
        self._by_name: Dict[int, Decision] = {}
        self._by_value: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether any function can go by name (the workers import a main script that could be read, or fork)."""
        return self._script is not None

    def sent_as(self, func: Any) -> Any:
        """What to pickle for ``func``: a :class:`MainFunction` when it can go by name, else ``func`` itself."""
        if self._script is None or type(func) is not types.FunctionType or func.__module__ != "__main__":
            return func
        main = sys.modules.get("__main__")
        main_globals = getattr(main, "__dict__", None)
        if main_globals is None or func.__globals__ is not main_globals:
            return func
        decision = self._by_name.get(id(func))
        if decision is not None and decision.holds(main_globals):
            return decision.stand_in  # the common case: checked again, a few identity tests
        if decision is None and func in self._by_value:
            return func
        with self._lock:
            decision = self._script.decide(func, main_globals)
            if decision is None:
                self._by_name.pop(id(func), None)
                self._by_value.add(func)
            else:
                self._by_name[id(func)] = decision
        return func if decision is None else decision.stand_in


class _Forked:
    """``__main__`` as the pool's forked workers have it: each name's object, each function's code and defaults."""

    def __init__(self, main_globals: Dict[str, Any]) -> None:
        # Held: the objects a global may be to go by name (functions, modules, classes, small constants);
        # only the names of the others, so that a large object the user drops later is not kept alive.
        self._values: Dict[str, Any] = {}
        self._others: Set[str] = set()
        for name, value in list(main_globals.items()):
            if _kept_at_fork(value):
                self._values[name] = value
            else:
                self._others.add(name)
        self._functions = {
            id(value): (value, value.__code__, value.__defaults__, value.__kwdefaults__)
            for value in self._values.values()
            if type(value) is types.FunctionType and not value.__dict__
        }

    @classmethod
    def of_main(cls) -> Optional[_Forked]:
        main_globals = getattr(sys.modules.get("__main__"), "__dict__", None)
        return None if main_globals is None else cls(main_globals)

    def decide(self, func: types.FunctionType, main_globals: Dict[str, Any]) -> Optional[Decision]:
        """The decision for ``func`` (see the module's docstring); None: by value."""
        return decision(func, lambda names, functions: self._by_name(func, main_globals, names, functions, set()))

    def _by_name(
        self,
        func: Any,
        main_globals: Dict[str, Any],
        names: Dict[str, Any],
        functions: List[Function],
        seen: Set[str],
    ) -> bool:
        """Whether the workers' copy of ``func`` (and of every function it reads) is the parent's as it is now."""
        name = getattr(func, "__name__", None)
        then = self._functions.get(id(func))
        if (
            not plain_def(func, main_globals)
            or main_globals.get(name) is not func
            or self._values.get(name) is not func
            or then is None
            or then[1] is not func.__code__
            or then[2] is not func.__defaults__
            or then[3] is not func.__kwdefaults__
        ):
            return False
        if name in seen:
            return True
        seen.add(name)
        names[name] = func
        functions.append(then)
        read, assigns = globals_of(func.__code__)
        if assigns:
            return False
        for global_name in read:
            if (global_name in DYNAMIC_BUILTINS and global_name not in main_globals) or global_name in self._others:
                return False
            value = main_globals.get(global_name, MISSING)
            if value is not self._values.get(global_name, MISSING):
                return False  # bound, rebound or deleted since the workers forked
            if value is MISSING:
                continue  # a builtin, or a NameError on both sides
            if type(value) is types.FunctionType and value.__module__ == "__main__":
                if not self._by_name(value, main_globals, names, functions, seen):
                    return False
            elif not (
                same_literal(value, value) or isinstance(value, types.ModuleType) or imported_by_reference(value)
            ):
                return False  # an object that may have changed since (a list, a class of __main__)
            names[global_name] = value
        return True


#: Constants larger than this are not kept from the fork (they go by value): a worker compares nothing with them.
_SMALL_CONSTANT = 4096


def _kept_at_fork(value: Any) -> bool:
    """Whether ``value`` is of a kind a global may be for a function to go by name under fork."""
    if type(value) is types.FunctionType:
        return value.__module__ == "__main__" or imported_by_reference(value)
    if isinstance(value, types.ModuleType):
        return True
    if type(value) in (str, bytes, tuple, frozenset) and len(value) > _SMALL_CONSTANT:
        return False
    if type(value) in (tuple, frozenset) and any(type(item) in (tuple, frozenset) for item in value):
        return False  # nested: its length does not bound its size
    return same_literal(value, value) or imported_by_reference(value)


__all__ = ["MainFunctions"]
