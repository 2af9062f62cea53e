"""What lets a function of ``__main__`` go by name: its code, its globals and their values checked.

A :class:`Decision` records what a function's going by name relies on: each
global it reads with its value, each function it calls with its code and
defaults. ``_main_functions`` decides, with the rules of the module that
knows where the workers' ``__main__`` comes from (``_main_script`` for a
script the workers run; a snapshot of the parent's for fork).
"""

from __future__ import annotations

import ast
import builtins
import dis
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

#: The plain types: immutable values holding no other object, which every pickler writes alike and a
#: worker recomputes identically from a literal. Tasks whose arguments are all plain need no routing.
PLAIN_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes})
#: Opcodes that read a global (a class body nested in the function reads through LOAD_NAME).
LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"})
STORES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL"})
#: Builtins that reach a function's globals by name at run time: the worker's module is not the parent's copy.
DYNAMIC_BUILTINS = frozenset({"globals", "eval", "exec", "vars", "locals", "__import__"})


def main_attribute(name: str) -> Any:
    """In a worker: the function ``name`` of its ``__main__`` (the parent's script run there, or the parent's
    ``__main__`` as the worker forked from it)."""
    main = sys.modules.get("__main__")
    try:
        return getattr(main, name)
    except AttributeError:
        raise RuntimeError(
            f"memshare: this worker's __main__ has no function {name!r}, which the parent sent by name"
        ) from None


class MainFunction:
    """Stands, in the parent, for a function of ``__main__`` that the workers have; pickles as its name.

    It calls the function and carries its names, so that error messages and
    anything else that looks at the task's function in the parent see it;
    the worker unpickles the function itself.
    """

    def __init__(self, function: types.FunctionType) -> None:
        self.function = function
        self.__name__ = self.__qualname__ = function.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    def __reduce__(self) -> Tuple[Callable[[str], Any], Tuple[str]]:
        return main_attribute, (self.__name__,)

    def __repr__(self) -> str:
        return f"<memshare.MainFunction __main__.{self.__name__}>"


#: A function a decision relies on, with its code, defaults and keyword defaults as they were.
Function = Tuple[types.FunctionType, types.CodeType, Any, Any]


@dataclass(frozen=True)
class Decision:
    """A function found to go by name, and what must still hold for that: checked before each task."""

    stand_in: MainFunction
    #: Each global read by the function (and the functions it reads), with its value then.
    names: Tuple[Tuple[str, Any], ...]
    #: Each function involved, with its code, defaults and keyword defaults then.
    functions: Tuple[Function, ...]

    def holds(self, main_globals: Dict[str, Any]) -> bool:
        for name, value in self.names:
            if main_globals.get(name, MISSING) is not value:
                return False
        for function, code, defaults, kwdefaults in self.functions:
            if (
                function.__code__ is not code
                or function.__defaults__ is not defaults
                or function.__kwdefaults__ is not kwdefaults
                or function.__dict__
            ):
                return False
        return True


MISSING = object()


def globals_of(code: types.CodeType) -> Tuple[Set[str], bool]:
    """The global names ``code`` (with the code nested in it) reads, and whether it assigns any."""
    read: Set[str] = set()
    assigns = False
    pending = [code]
    while pending:
        current = pending.pop()
        for instruction in dis.get_instructions(current):
            if instruction.opname in LOADS:
                read.add(instruction.argval)
            elif instruction.opname in STORES:
                assigns = True
        pending.extend(const for const in current.co_consts if isinstance(const, types.CodeType))
    return read, assigns


def decision(func: types.FunctionType, walk: Callable[[Dict[str, Any], List[Function]], bool]) -> Optional[Decision]:
    """The decision to send ``func`` by name, if ``walk`` allows it; None: by value.

    ``walk`` is a start method's check of ``func`` and of the functions it
    reads, which fills in the globals and functions the decision relies on.
    """
    names: Dict[str, Any] = {}
    functions: List[Function] = []
    if not walk(names, functions):
        return None
    return Decision(MainFunction(func), tuple(names.items()), tuple(functions))


def plain_def(func: Any, main_globals: Dict[str, Any]) -> bool:
    """True when ``func`` is a plain function defined at the top level of ``__main__`` (with ``main_globals``).

    No closure and no attributes of its own, which a worker's copy of the
    script would not have.
    """
    return (
        type(func) is types.FunctionType
        and func.__module__ == "__main__"
        and func.__qualname__ == func.__name__
        and func.__closure__ is None
        and not func.__dict__
        and func.__globals__ is main_globals
    )


def same_literal(value: Any, literal: Any) -> bool:
    """True when ``value`` is the immutable literal ``literal``, as the worker computes it from the file."""
    if type(value) is not type(literal):
        return False
    if type(literal) in (tuple, frozenset):
        if len(value) != len(literal):
            return False
        if type(literal) is frozenset:
            return value == literal and all(type(item) in PLAIN_TYPES for item in value)
        return all(same_literal(item, other) for item, other in zip(value, literal))
    if type(literal) not in PLAIN_TYPES:
        return False
    if type(literal) is float and literal != literal:  # nan: equal to nothing, but the same literal
        return value != value
    return bool(value == literal)


def same_defaults(func: types.FunctionType, node: Any) -> bool:
    """True when the function's defaults are the literals of its ``def``, as a worker computes them."""
    arguments = node.args
    defaults = func.__defaults__ or ()
    if len(defaults) != len(arguments.defaults):
        return False
    for value, expression in zip(defaults, arguments.defaults):
        if not is_literal_value(value, expression):
            return False
    kwdefaults = func.__kwdefaults__ or {}
    expected = {arg.arg: default for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults) if default}
    if set(kwdefaults) != set(expected):
        return False
    return all(is_literal_value(kwdefaults[name], expression) for name, expression in expected.items())


def is_literal_value(value: Any, expression: ast.AST) -> bool:
    try:
        literal = ast.literal_eval(expression)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return same_literal(value, literal)


def is_imported(value: Any, imported: Tuple[str, ...]) -> bool:
    """True when ``value`` is what the import statement gives a worker: the module it names, or the class
    or function it takes from a module, which pickling would find again by its module and name too."""
    if imported[0] == "module":
        return isinstance(value, types.ModuleType) and sys.modules.get(imported[1]) is value
    module = sys.modules.get(imported[1])
    if module is None or getattr(module, imported[2], MISSING) is not value:
        return False
    return isinstance(value, types.ModuleType) or imported_by_reference(value)


def imported_by_reference(value: Any) -> bool:
    """True for a class or function that pickling finds again by its module and name."""
    if not isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return False
    module_name = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str) or module_name in ("__main__", "builtins"):
        return module_name == "builtins" and getattr(builtins, qualname or "", None) is value
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found is value


__all__ = [
    "DYNAMIC_BUILTINS",
    "MISSING",
    "PLAIN_TYPES",
    "Decision",
    "Function",
    "MainFunction",
    "decision",
    "globals_of",
    "imported_by_reference",
    "is_imported",
    "main_attribute",
    "plain_def",
    "same_defaults",
    "same_literal",
]
