"""The main script as forkserver and spawn workers run it: the file read once, its top-level bindings counted."""

from __future__ import annotations

import ast
import multiprocessing.process
import os
import sys
import threading
import tokenize
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from ._main_values import (
    DYNAMIC_BUILTINS,
    Decision,
    Function,
    decision,
    globals_of,
    is_imported,
    plain_def,
    same_defaults,
    same_literal,
)


def script_of_main() -> Optional[Script]:
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
            script = _SCRIPTS[key] = Script(path, key)
    return script


# One per file and version, for every pool of the process: each file is read and compiled once. Guarded by the lock.
_SCRIPTS: Dict[tuple, Script] = {}
_SCRIPTS_LOCK = threading.Lock()


@dataclass
class Bindings:
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


class Script:
    """The main script's file, parsed and compiled on first use (then not read again)."""

    def __init__(self, path: str, key: tuple) -> None:
        self.path = path
        self._key = key
        self._loaded = False
        self._bindings: Optional[Bindings] = None
        self._codes: Dict[str, types.CodeType] = {}
        self._lock = threading.Lock()  # two pools of one process may decide at once

    def _load(self) -> Optional[Bindings]:
        with self._lock:
            return self._load_once()

    def _load_once(self) -> Optional[Bindings]:
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
            bindings = module_bindings(tree)
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

    def decide(self, func: types.FunctionType, main_globals: Dict[str, Any]) -> Optional[Decision]:
        """The decision for ``func`` (see the module's docstring); None: by value."""
        bindings = self._load()
        if bindings is None:
            return None
        return decision(
            func, lambda names, functions: self._by_name(func, main_globals, bindings, names, functions, set())
        )

    def _by_name(
        self,
        func: Any,
        main_globals: Dict[str, Any],
        bindings: Bindings,
        names: Dict[str, Any],
        functions: List[Function],
        seen: Set[str],
    ) -> bool:
        """Whether ``func`` (and every function of the file it reads) behaves in a worker as in the parent."""
        name = getattr(func, "__name__", None)
        if (
            not plain_def(func, main_globals)
            or not bindings.once(name, bindings.defs)
            or main_globals.get(name) is not func
            or self._codes.get(name) != func.__code__
            or not same_defaults(func, bindings.defs[name])
        ):
            return False
        if name in seen:
            return True
        seen.add(name)
        names[name] = func
        functions.append((func, func.__code__, func.__defaults__, func.__kwdefaults__))
        read, assigns = globals_of(func.__code__)
        if assigns:
            return False
        for global_name in read:
            if global_name in DYNAMIC_BUILTINS and global_name not in main_globals:
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
                if not same_literal(value, bindings.literals[global_name]):
                    return False
            elif bindings.only_imported(global_name) is not None:
                if not is_imported(value, bindings.only_imported(global_name)):
                    return False
            else:
                return False
            names[global_name] = value
        return True


def module_bindings(tree: ast.Module) -> Bindings:
    """Every module-level binding in the file, counted per name, and the top-level ones that may go by name."""
    bindings = Bindings()
    count_bindings(tree, bindings)
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


def count_bindings(tree: ast.Module, bindings: Bindings) -> None:
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


__all__ = ["Script", "script_of_main"]
