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

import ast
import builtins
import dis
import multiprocessing.process
import os
import sys
import threading
import tokenize
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

#: Start methods whose workers run the parent's main script when they start.
_IMPORTING_METHODS = ("forkserver", "spawn")
#: The plain types: immutable values holding no other object, which every pickler writes alike and a
#: worker recomputes identically from a literal. Tasks whose arguments are all plain need no routing.
PLAIN_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes})
#: Opcodes that read a global (a class body nested in the function reads through LOAD_NAME).
_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"})
_STORES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL"})
#: Builtins that reach a function's globals by name at run time: the worker's module is not the parent's copy.
_DYNAMIC_BUILTINS = frozenset({"globals", "eval", "exec", "vars", "locals", "__import__"})


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
_Function = Tuple[types.FunctionType, types.CodeType, Any, Any]


@dataclass(frozen=True)
class _Decision:
    """A function found to go by name, and what must still hold for that: checked before each task."""

    stand_in: MainFunction
    #: Each global read by the function (and the functions it reads), with its value then.
    names: Tuple[Tuple[str, Any], ...]
    #: Each function involved, with its code, defaults and keyword defaults then.
    functions: Tuple[_Function, ...]

    def holds(self, main_globals: Dict[str, Any]) -> bool:
        for name, value in self.names:
            if main_globals.get(name, _MISSING) is not value:
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


_MISSING = object()


class MainFunctions:
    """For one pool: which functions of ``__main__`` its workers have, each decided once. Thread-safe."""

    def __init__(self, start_method: str) -> None:
        """Call it before the pool starts its workers: under fork, they get ``__main__`` as it is now."""
        self._script: Optional[Union[_Script, _Forked]] = None
        if start_method in _IMPORTING_METHODS:
            self._script = _script_of_main()
        elif start_method == "fork":
            self._script = _Forked.of_main()
        # id(function) -> its decision to go by name, which holds the function (so the id names no other):
        # top-level functions of __main__, which live as long as it. Functions that go by value (lambdas,
        # closures, made anew for each call) are held weakly, to be forgotten with them.
        self._by_name: Dict[int, _Decision] = {}
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

    def decide(self, func: types.FunctionType, main_globals: Dict[str, Any]) -> Optional[_Decision]:
        """The decision for ``func`` (see the module's docstring); None: by value."""
        return _decision(func, lambda names, functions: self._by_name(func, main_globals, names, functions, set()))

    def _by_name(
        self,
        func: Any,
        main_globals: Dict[str, Any],
        names: Dict[str, Any],
        functions: List[_Function],
        seen: Set[str],
    ) -> bool:
        """Whether the workers' copy of ``func`` (and of every function it reads) is the parent's as it is now."""
        name = getattr(func, "__name__", None)
        then = self._functions.get(id(func))
        if (
            not _plain_def(func, main_globals)
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
        read, assigns = _globals_of(func.__code__)
        if assigns:
            return False
        for global_name in read:
            if (global_name in _DYNAMIC_BUILTINS and global_name not in main_globals) or global_name in self._others:
                return False
            value = main_globals.get(global_name, _MISSING)
            if value is not self._values.get(global_name, _MISSING):
                return False  # bound, rebound or deleted since the workers forked
            if value is _MISSING:
                continue  # a builtin, or a NameError on both sides
            if type(value) is types.FunctionType and value.__module__ == "__main__":
                if not self._by_name(value, main_globals, names, functions, seen):
                    return False
            elif not (
                _same_literal(value, value) or isinstance(value, types.ModuleType) or _imported_by_reference(value)
            ):
                return False  # an object that may have changed since (a list, a class of __main__)
            names[global_name] = value
        return True


#: Constants larger than this are not kept from the fork (they go by value): a worker compares nothing with them.
_SMALL_CONSTANT = 4096


def _kept_at_fork(value: Any) -> bool:
    """Whether ``value`` is of a kind a global may be for a function to go by name under fork."""
    if type(value) is types.FunctionType:
        return value.__module__ == "__main__" or _imported_by_reference(value)
    if isinstance(value, types.ModuleType):
        return True
    if type(value) in (str, bytes, tuple, frozenset) and len(value) > _SMALL_CONSTANT:
        return False
    if type(value) in (tuple, frozenset) and any(type(item) in (tuple, frozenset) for item in value):
        return False  # nested: its length does not bound its size
    return _same_literal(value, value) or _imported_by_reference(value)


def _script_of_main() -> Optional[_Script]:
    """The main script the workers will run, read lazily; None when they run none (or it is not a file)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not isinstance(path, str) or (path.startswith("<") and path.endswith(">")):
        return None  # python -c, a notebook, standard input (see _pool_args)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None and (spec_name == "__main__" or spec_name.endswith(".__main__")):
        return None  # python -m package: the workers do not run a package's __main__
    if os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None  # the workers do not run IPython's launcher either
    if not os.path.isabs(path):
        path = os.path.join(multiprocessing.process.ORIGINAL_DIR or os.getcwd(), path)
    path = os.path.normpath(path)
    try:
        stat = os.stat(path)
    except OSError:
        return None
    key = (path, stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    with _SCRIPTS_LOCK:
        script = _SCRIPTS.get(key)
        if script is None:
            script = _SCRIPTS[key] = _Script(path, key)
    return script


_SCRIPTS: Dict[tuple, _Script] = {}
_SCRIPTS_LOCK = threading.Lock()


@dataclass
class _Bindings:
    """What the file binds at module level: every binding of each name, and the ones that may go by name."""

    count: Dict[str, int] = field(default_factory=dict)
    defs: Dict[str, ast.AST] = field(default_factory=dict)  # undecorated top-level def
    literals: Dict[str, Any] = field(default_factory=dict)  # top-level NAME = immutable literal
    #: Top-level imports: what each binds the name to, ("module", name) or ("from", module, name).
    imports: Dict[str, List[Tuple[str, ...]]] = field(default_factory=dict)
    star_import: bool = False

    def once(self, name: str, table: Any) -> bool:
        return self.count.get(name) == 1 and name in table

    def only_imported(self, name: str) -> Optional[Tuple[str, ...]]:
        """What every binding of ``name`` imports, when all are top-level imports of one thing; else None."""
        imported = self.imports.get(name)
        if not imported or self.count.get(name) != len(imported) or len(set(imported)) != 1:
            return None
        return imported[0]


class _Script:
    """The main script's file, parsed and compiled on first use (then not read again)."""

    def __init__(self, path: str, key: tuple) -> None:
        self.path = path
        self._key = key
        self._loaded = False
        self._bindings: Optional[_Bindings] = None
        self._codes: Dict[str, types.CodeType] = {}
        self._lock = threading.Lock()  # two pools of one process may decide at once

    def _load(self) -> Optional[_Bindings]:
        with self._lock:
            return self._load_once()

    def _load_once(self) -> Optional[_Bindings]:
        if not self._loaded:
            self._loaded = True
            try:
                with tokenize.open(self.path) as source_file:
                    source = source_file.read()
                stat = os.stat(self.path)
                if (self.path, stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns) != self._key:
                    return None  # changed since the pool started: which version the workers run is unknown
                tree = ast.parse(source, self.path)
                module_code = compile(tree, self.path, "exec", dont_inherit=True)
            except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
                return None
            bindings = _module_bindings(tree)
            if not bindings.star_import:
                self._bindings = bindings
                self._codes = {
                    const.co_name: const
                    for const in module_code.co_consts
                    if isinstance(const, types.CodeType)
                    and const.co_name in bindings.defs
                    and const.co_firstlineno == bindings.defs[const.co_name].lineno
                }
        return self._bindings

    def decide(self, func: types.FunctionType, main_globals: Dict[str, Any]) -> Optional[_Decision]:
        """The decision for ``func`` (see the module's docstring); None: by value."""
        bindings = self._load()
        if bindings is None:
            return None
        return _decision(
            func, lambda names, functions: self._by_name(func, main_globals, bindings, names, functions, set())
        )

    def _by_name(
        self,
        func: Any,
        main_globals: Dict[str, Any],
        bindings: _Bindings,
        names: Dict[str, Any],
        functions: List[_Function],
        seen: Set[str],
    ) -> bool:
        """Whether ``func`` (and every function of the file it reads) behaves in a worker as in the parent."""
        name = getattr(func, "__name__", None)
        if (
            not _plain_def(func, main_globals)
            or not bindings.once(name, bindings.defs)
            or main_globals.get(name) is not func
            or self._codes.get(name) != func.__code__
            or not _same_defaults(func, bindings.defs[name])
        ):
            return False
        if name in seen:
            return True
        seen.add(name)
        names[name] = func
        functions.append((func, func.__code__, func.__defaults__, func.__kwdefaults__))
        read, assigns = _globals_of(func.__code__)
        if assigns:
            return False
        for global_name in read:
            if global_name in _DYNAMIC_BUILTINS and global_name not in main_globals:
                return False
            if global_name not in main_globals:
                if global_name in bindings.count:
                    return False  # bound later or elsewhere: the worker may have a value the parent lacks
                continue  # a builtin, or a NameError on both sides
            value = main_globals[global_name]
            if bindings.once(global_name, bindings.defs):
                if not self._by_name(value, main_globals, bindings, names, functions, seen):
                    return False
            elif bindings.once(global_name, bindings.literals):
                if not _same_literal(value, bindings.literals[global_name]):
                    return False
            elif bindings.only_imported(global_name) is not None:
                if not _is_imported(value, bindings.only_imported(global_name)):
                    return False
            else:
                return False
            names[global_name] = value
        return True


def _globals_of(code: types.CodeType) -> Tuple[Set[str], bool]:
    """The global names ``code`` (with the code nested in it) reads, and whether it assigns any."""
    read: Set[str] = set()
    assigns = False
    pending = [code]
    while pending:
        current = pending.pop()
        for instruction in dis.get_instructions(current):
            if instruction.opname in _LOADS:
                read.add(instruction.argval)
            elif instruction.opname in _STORES:
                assigns = True
        pending.extend(const for const in current.co_consts if isinstance(const, types.CodeType))
    return read, assigns


def _decision(func: types.FunctionType, walk: Callable[[Dict[str, Any], List[_Function]], bool]) -> Optional[_Decision]:
    """The decision to send ``func`` by name, if ``walk`` allows it; None: by value.

    ``walk`` is a start method's check of ``func`` and of the functions it
    reads, which fills in the globals and functions the decision relies on.
    """
    names: Dict[str, Any] = {}
    functions: List[_Function] = []
    if not walk(names, functions):
        return None
    return _Decision(MainFunction(func), tuple(names.items()), tuple(functions))


def _plain_def(func: Any, main_globals: Dict[str, Any]) -> bool:
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


def _same_literal(value: Any, literal: Any) -> bool:
    """True when ``value`` is the immutable literal ``literal``, as the worker computes it from the file."""
    if type(value) is not type(literal):
        return False
    if type(literal) in (tuple, frozenset):
        if len(value) != len(literal):
            return False
        if type(literal) is frozenset:
            return value == literal and all(type(item) in PLAIN_TYPES for item in value)
        return all(_same_literal(item, other) for item, other in zip(value, literal))
    if type(literal) not in PLAIN_TYPES:
        return False
    if type(literal) is float and literal != literal:  # nan: equal to nothing, but the same literal
        return value != value
    return bool(value == literal)


def _same_defaults(func: types.FunctionType, node: Any) -> bool:
    """True when the function's defaults are the literals of its ``def``, as a worker computes them."""
    arguments = node.args
    defaults = func.__defaults__ or ()
    if len(defaults) != len(arguments.defaults):
        return False
    for value, expression in zip(defaults, arguments.defaults):
        if not _is_literal_value(value, expression):
            return False
    kwdefaults = func.__kwdefaults__ or {}
    expected = {arg.arg: default for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults) if default}
    if set(kwdefaults) != set(expected):
        return False
    return all(_is_literal_value(kwdefaults[name], expression) for name, expression in expected.items())


def _is_literal_value(value: Any, expression: ast.AST) -> bool:
    try:
        literal = ast.literal_eval(expression)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return _same_literal(value, literal)


def _is_imported(value: Any, imported: Tuple[str, ...]) -> bool:
    """True when ``value`` is what the import statement gives a worker: the module it names, or the class
    or function it takes from a module, which pickling would find again by its module and name too."""
    if imported[0] == "module":
        return isinstance(value, types.ModuleType) and sys.modules.get(imported[1]) is value
    module = sys.modules.get(imported[1])
    if module is None or getattr(module, imported[2], _MISSING) is not value:
        return False
    return isinstance(value, types.ModuleType) or _imported_by_reference(value)


def _imported_by_reference(value: Any) -> bool:
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


def _module_bindings(tree: ast.Module) -> _Bindings:
    """Every module-level binding in the file, counted per name, and the top-level ones that may go by name."""
    bindings = _Bindings()
    _count_bindings(tree, bindings)
    for statement in tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and not statement.decorator_list:
            bindings.defs[statement.name] = statement
        elif isinstance(statement, ast.Import):
            for alias in statement.names:
                if alias.asname:
                    imported: Tuple[str, ...] = ("module", alias.name)
                    bindings.imports.setdefault(alias.asname, []).append(imported)
                else:  # import a.b binds a
                    top = alias.name.split(".")[0]
                    bindings.imports.setdefault(top, []).append(("module", top))
        elif isinstance(statement, ast.ImportFrom) and not statement.level and statement.module:
            for alias in statement.names:
                imported = ("from", statement.module, alias.name)
                bindings.imports.setdefault(alias.asname or alias.name, []).append(imported)
        elif isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None:
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name):
                try:
                    bindings.literals[targets[0].id] = ast.literal_eval(statement.value)
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    pass
    return bindings


def _count_bindings(tree: ast.Module, bindings: _Bindings) -> None:
    """Count each binding of a module-level name: anywhere outside function and class bodies, and
    every ``global`` statement inside them. Counting a local name as well only sends more by value."""

    def add(name: str) -> None:
        bindings.count[name] = bindings.count.get(name, 0) + 1

    def visit(node: ast.AST, module_scope: bool) -> None:
        if isinstance(node, ast.Global):
            for name in node.names:
                add(name)
            return
        if module_scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    if alias.name == "*":
                        bindings.star_import = True
                    else:
                        add((alias.asname or alias.name).split(".")[0])
            elif isinstance(node, ast.ExceptHandler) and node.name:
                add(node.name)
            elif type(node).__name__ in ("MatchAs", "MatchStar") and getattr(node, "name", None):
                add(node.name)
            elif type(node).__name__ == "MatchMapping" and getattr(node, "rest", None):
                add(node.rest)
        for name, child in ast.iter_fields(node):
            inner = module_scope
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and name == "body":
                inner = False
            elif isinstance(node, ast.ClassDef) and name == "body":
                inner = False
            for item in child if isinstance(child, list) else [child]:
                if isinstance(item, ast.AST):
                    visit(item, inner)

    visit(tree, True)


__all__ = ["MainFunction", "MainFunctions", "main_attribute"]
