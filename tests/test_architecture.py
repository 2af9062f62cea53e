"""The package keeps the shape ARCHITECTURE.md gives it.

Three rules are read from the source itself (``ast``), so that breaking one
fails here, naming the file and line (or the rows to paste), rather than in a
review:

- a private name of another library (joblib, loky, numpy, pandas,
  multiprocessing, threading, concurrent.futures, cloudpickle...) is used only
  in ``_compat``;
- no module uses a private name of another memshare module;
- ARCHITECTURE.md's module table lists every module of the package, each with
  the first line of its docstring.

What counts as a private name of another library, outside ``_compat``:

- importing a private name or a private module of another package
  (``from joblib.parallel import _backend``, ``from numpy._core import x``);
- an attribute ``_x`` of an imported foreign module (``loky_module._x``);
- in a class with a foreign base, ``self._x``, ``cls._x``, ``super()._x``, or
  a method ``_x``, where a foreign base defines or uses ``_x``: an inherited
  private attribute, or the override of a private hook (``Pool._pool``,
  ``Pool._setup_queues``). A private name the class makes up itself is fine;
- ``obj._x`` on any other object when no module of memshare defines ``_x``
  (as a function, class, method, or an attribute or name it assigns): it can
  only be another library's. Reading ``getattr(obj, "_x")``, ``hasattr``,
  ``setattr``, ``delattr`` and ``"_x" in vars(obj)`` / ``obj.__dict__`` count
  as ``obj._x``, and so does a key ``"_x"`` of a subscript or an ``in`` test
  (another object's state, such as a copy of its ``__dict__``).

A private name that some memshare module defines is taken to be memshare's
own: the scan cannot tell it from a foreign object's attribute of the same
name. Used by another memshare module than the ones defining it, it breaks
the rule "no reaching into another module's privates", which
:func:`memshare_privates_across_modules` lists and a test of its own enforces.
"""

from __future__ import annotations

import ast
import difflib
import dis
import importlib
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "memshare"  # the sources, whichever copy of memshare is installed
COMPAT = "_compat"

#: Underscore names that their library documents as public API.
DOCUMENTED = {
    ("os", "_exit"): "os._exit: documented, the exit of a forked child that must not run cleanup",
}
#: Attributes of namedtuples, public API despite the underscore.
NAMEDTUPLE_API = {"_asdict", "_replace", "_fields", "_make", "_field_defaults"}


# -- reading the package ---------------------------------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name != "_"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> List[Tuple[Path, str, ast.Module]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        found.append((path, _module_name(path), ast.parse(path.read_text(encoding="utf-8"), str(path))))
    return found


def _absolute(package: str, node: ast.ImportFrom) -> str:
    """The absolute name of the module an ``import from`` names, from a module of ``package``."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _package(path: Path, module: str) -> str:
    """The package a relative import starts from: the module itself for an ``__init__.py``."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _is_memshare(module: str) -> bool:
    return module == "memshare" or module.startswith("memshare.")


def _imported_modules(package: str, tree: ast.Module) -> Dict[str, str]:
    """Each name a module binds to a module by importing it, and that module's full name."""
    modules: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    modules[alias.asname] = alias.name
                else:
                    modules[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(package, node)
            for alias in node.names:
                if _is_module(f"{source}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{source}.{alias.name}"
    return modules


def _is_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _defined_names(tree: ast.Module) -> Set[str]:
    """Every private name a module defines: functions, classes, methods, names and attributes it assigns."""
    defined: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.alias):
            defined.add(node.asname or node.name.split(".")[0])
    return {name for name in defined if _private(name)}


def _foreign_privates(cls: type) -> Set[str]:
    """The private names the foreign classes among ``cls``'s bases define or use as attributes."""
    names: Set[str] = set()
    for klass in cls.__mro__:
        if _is_memshare(klass.__module__) or klass is object:
            continue
        for name, member in vars(klass).items():
            names.add(name)
            function = getattr(member, "__func__", member)
            if isinstance(function, property):
                function = function.fget
            code = getattr(function, "__code__", None)
            if code is not None:
                names |= _attributes_in(code)
    return {name for name in names if _private(name)}


_ATTRIBUTE_OPS = {"LOAD_ATTR", "STORE_ATTR", "DELETE_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"}


def _attributes_in(code: types.CodeType) -> Set[str]:
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in _ATTRIBUTE_OPS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _attributes_in(const)
    return {name for name in names if isinstance(name, str)}


# -- the scan ---------------------------------------------------------------------


@dataclass(frozen=True)
class Use:
    """One use of a private name: where, which, and what it reaches."""

    path: str
    line: int
    name: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.name} ({self.what})"


_ATTRIBUTE_FUNCTIONS = {"getattr", "hasattr", "setattr", "delattr"}


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: Path, module: str, tree: ast.Module, defined_in: Dict[str, Set[str]]) -> None:
        self.path = str(path.relative_to(ROOT))
        self.module = module
        self.package = _package(path, module)
        self.modules = _imported_modules(self.package, tree)
        self.defined_in = defined_in
        self.foreign: List[Use] = []
        self.across: List[Use] = []
        self._classes: List[Set[str]] = []  # the foreign privates of each enclosing class
        self._scopes: List[str] = []  # "class" or "function", innermost last
        self._self_names: List[str] = []  # the first argument of each enclosing method
        try:
            self._runtime = importlib.import_module(module)
        except ImportError:
            self._runtime = None

    # -- imports

    def visit_Import(self, node: ast.Import) -> None:  # noqa: N802 (ast's name)
        for alias in node.names:
            if not _is_memshare(alias.name) and any(_private(part) for part in alias.name.split(".")):
                self._foreign(node, alias.name, "a private module of another package")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:  # noqa: N802
        source = _absolute(self.package, node)
        if _is_memshare(source):
            for alias in node.names:
                if _private(alias.name) and not _is_module(f"{source}.{alias.name}"):
                    self._across(node, f"{source}.{alias.name}", "imported from another memshare module")
            return
        if any(_private(part) for part in source.split(".")):
            self._foreign(node, source, "a private module of another package")
        for alias in node.names:
            if _private(alias.name):
                self._foreign(node, f"{source}.{alias.name}", "a private name of another package")

    # -- classes

    def visit_ClassDef(self, node: ast.ClassDef) -> None:  # noqa: N802
        cls = getattr(self._runtime, node.name, None) if not self._classes else None
        privates = _foreign_privates(cls) if isinstance(cls, type) else self._static_foreign_bases(node)
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in privates:
                self._foreign(item, item.name, "overrides a private method of a foreign base class")
        self._classes.append(privates)
        self._scopes.append("class")
        self.generic_visit(node)
        self._scopes.pop()
        self._classes.pop()

    def _static_foreign_bases(self, node: ast.ClassDef) -> Set[str]:
        """For a class not reachable at import (nested, or made in a function): its foreign bases by name."""
        names: Set[str] = set()
        for base in node.bases:
            try:
                value = eval(compile(ast.Expression(base), "<base>", "eval"), vars(self._runtime))  # noqa: S307
            except Exception:
                continue
            if isinstance(value, type):
                names |= _foreign_privates(value)
        return names

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:  # noqa: N802
        # A method's first argument is its instance (or class), also in the functions nested in it.
        arguments = node.args.posonlyargs + node.args.args
        in_class_body = bool(self._scopes) and self._scopes[-1] == "class"
        is_method = in_class_body and bool(arguments) and not self._decorated_static(node)
        if is_method:
            self._self_names.append(arguments[0].arg)
        self._scopes.append("function")
        self.generic_visit(node)
        self._scopes.pop()
        if is_method:
            self._self_names.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815

    @staticmethod
    def _decorated_static(node: ast.FunctionDef) -> bool:
        return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)

    # -- attributes

    def visit_Attribute(self, node: ast.Attribute) -> None:  # noqa: N802
        if _private(node.attr):
            self._judge(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:  # noqa: N802
        if (
            isinstance(node.func, ast.Name)
            and node.func.id in _ATTRIBUTE_FUNCTIONS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            self._judge(node, node.args[0], node.args[1].value)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:  # noqa: N802
        # "_x" in obj.__dict__, "_x" in vars(obj), "_x" in state
        key = _private_key(node.left)
        if key is not None and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            self._judge(node, _owner_of_state(node.comparators[0]), key)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:  # noqa: N802
        # state["_x"]
        key = _private_key(node.slice)
        if key is not None:
            self._judge(node, _owner_of_state(node.value), key)
        self.generic_visit(node)

    def _judge(self, node: ast.AST, owner: ast.expr, name: str) -> None:
        if self._is_self(owner) or self._is_super(owner):
            if self._classes and name in self._classes[-1]:
                self._foreign(node, name, "a private attribute of a foreign base class")
            return
        if isinstance(owner, ast.Name) and owner.id in self.modules:
            target = self.modules[owner.id]
            if _is_memshare(target):
                if target != self.module:
                    self._across(node, f"{target}.{name}", "a private name of another memshare module")
            elif (target, name) not in DOCUMENTED:
                self._foreign(node, f"{target}.{name}", "a private name of another library's module")
            return
        if name in NAMEDTUPLE_API:
            return
        modules = self.defined_in.get(name, set())
        if not modules:
            self._foreign(node, f"{ast.unparse(owner)}.{name}", "defined by no memshare module: another library's")
        elif self.module not in modules:
            self._across(node, f"{ast.unparse(owner)}.{name}", f"defined in {', '.join(sorted(modules))}")

    def _is_self(self, owner: ast.expr) -> bool:
        return bool(self._self_names) and isinstance(owner, ast.Name) and owner.id == self._self_names[-1]

    @staticmethod
    def _is_super(owner: ast.expr) -> bool:
        return isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"

    def _foreign(self, node: ast.AST, name: str, what: str) -> None:
        self.foreign.append(Use(self.path, node.lineno, name, what))

    def _across(self, node: ast.AST, name: str, what: str) -> None:
        self.across.append(Use(self.path, node.lineno, name, what))


def _private_key(node: ast.expr) -> Optional[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and _private(node.value):
        if node.value.isidentifier():
            return node.value
    return None


def _owner_of_state(container: ast.expr) -> ast.expr:
    """``obj`` for ``obj.__dict__`` and ``vars(obj)``; the container itself otherwise."""
    if isinstance(container, ast.Attribute) and container.attr == "__dict__":
        return container.value
    if isinstance(container, ast.Call) and isinstance(container.func, ast.Name) and container.func.id == "vars":
        if container.args:
            return container.args[0]
    return container


def _scan() -> Tuple[List[Use], List[Use]]:
    sources = _sources()
    defined_in: Dict[str, Set[str]] = {}
    for _, module, tree in sources:
        for name in _defined_names(tree):
            defined_in.setdefault(name, set()).add(module)
    foreign: List[Use] = []
    across: List[Use] = []
    for path, module, tree in sources:
        scanner = _Scanner(path, module, tree, defined_in)
        scanner.visit(tree)
        if module.split(".")[:2] != ["memshare", COMPAT]:  # the one package where both are expected
            foreign += scanner.foreign
            across += scanner.across
    return foreign, across


def foreign_privates_outside_compat() -> List[Use]:
    """Every use of another library's private name outside ``_compat``."""
    return _scan()[0]


def memshare_privates_across_modules() -> List[Use]:
    """Every use of a private name that another memshare module defines (reported, not enforced)."""
    return _scan()[1]


def test_foreign_private_names_are_used_only_through_compat():
    uses = foreign_privates_outside_compat()
    assert not uses, (
        "Private names of other libraries used outside memshare/_compat/; give each a function "
        "(or a hook) in _compat with its line of why and a CHECKS entry:\n" + "\n".join(map(str, uses))
    )


def test_no_module_reaches_into_another_modules_privates():
    uses = memshare_privates_across_modules()
    assert not uses, (
        "Private names of one memshare module used by another; make the name public in its module "
        "(no underscore) or keep the use inside the module:\n" + "\n".join(map(str, uses))
    )


PROBE = """
import multiprocessing.pool as mp_pool
from joblib.parallel import _backend
from concurrent.futures._base import Future
from ._compat._processes import _same


class Mine(mp_pool.Pool):
    def _setup_queues(self):
        super()._setup_queues()
        return self._cache, self._own

    def own(self):
        self._own = getattr(self, "_processes")

        def nested(other):
            return other._own, self._taskqueue

        return "_state" in self.__dict__, nested


def reach(lock, obj):
    state = dict(obj.__dict__)
    state["_hidden"] = None
    return lock._at_fork_reinit, mp_pool._helper_reraises_exception, _same
"""


def test_the_scan_finds_each_kind_of_private_use():
    """The scan itself: each kind of use it promises to find, in a module made up for it."""
    tree = ast.parse(PROBE)
    module = "memshare._probe"
    scanner = _Scanner(
        PACKAGE / "_probe.py", module, tree, {"_own": {module}, "_same": {"memshare._compat._processes"}}
    )
    scanner._runtime = types.ModuleType(module)
    scanner._runtime.__package__ = "memshare"
    exec(compile(tree, "_probe.py", "exec"), vars(scanner._runtime))  # noqa: S102
    scanner.visit(tree)
    foreign = {use.name.rsplit(".", 1)[-1] for use in scanner.foreign}
    assert foreign == {
        "_backend",  # a private name imported from another package
        "_base",  # a private module of another package
        "_setup_queues",  # a private hook overridden, and called through super()
        "_cache",  # a private attribute inherited from a foreign base
        "_processes",  # the same, through getattr
        "_taskqueue",  # the same, in a function nested in a method
        "_state",  # the same, through __dict__
        "_hidden",  # a key of another object's state
        "_at_fork_reinit",  # an attribute no memshare module defines
        "_helper_reraises_exception",  # a private name of a foreign module
    }, [str(use) for use in scanner.foreign]
    assert [use.name for use in scanner.across] == ["memshare._compat._processes._same"]


# -- the module table ------------------------------------------------------------------


def _first_line(doc: Optional[str]) -> str:
    """A docstring's first line as Markdown: ``x`` and :role:`x` become `x`."""
    line = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
    line = re.sub(r":[a-z]+:`~?(?:[\w.]+\.)?([^`]+)`", r"`\1`", line)
    return line.replace("``", "`")


def _c_extension_doc(source: Path) -> str:
    """The docstring a C extension gives its module (``PyModuleDef``'s third field)."""
    text = source.read_text(encoding="utf-8")
    match = re.search(r'PyModuleDef_HEAD_INIT\s*,\s*"[^"]*"\s*,\s*((?:"(?:[^"\\]|\\.)*"\s*)+)', text)
    assert match, f"{source}: no module docstring found in its PyModuleDef"
    literals = re.findall(r'"((?:[^"\\]|\\.)*)"', match.group(1))
    return "".join(literals).encode().decode("unicode_escape")


#: The runtime's layers, top first: a module may import from its own package, from a layer below its
#: own and from the base modules at the top level. Layers that share a row are siblings that do not
#: import each other. ARCHITECTURE.md's "## Modules" gives each a table.
LAYERS = (("_frontends",), ("_parent", "_worker"), ("_payload",), ("_transport",), ("_lifetime",))
#: Top-level private modules every layer may use: they import nothing of memshare's but each other.
BASE = ("_errors", "_config", "_compat", "_stats", "_forksafe", "_numpy")
#: Imports that go the wrong way today, each with why; the list only shrinks.
UPWARD: Dict[Tuple[str, str], str] = {}


def _module_rows(folder: Path, prefix: str) -> Dict[str, str]:
    rows: Dict[str, str] = {}
    for path in sorted(folder.iterdir()):
        if path.is_dir() and (path / "__init__.py").exists():
            doc = ast.get_docstring(ast.parse((path / "__init__.py").read_text(encoding="utf-8")))
            rows[f"`{prefix}{path.name}/`"] = _first_line(doc)
        elif path.suffix == ".py" and path.stem != "__init__" or path.name == "__init__.py" and not prefix:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
            rows[f"`{prefix}{path.stem}`"] = _first_line(doc)
        elif path.suffix == ".c":
            rows[f"`{prefix}{path.stem}` (C)"] = _first_line(_c_extension_doc(path))
    return rows


def package_rows() -> Dict[str, str]:
    """The package's module tables: each module's name as ARCHITECTURE.md writes it, and its first line.

    The top level's modules and sub-packages, then each layer's modules, named ``_layer/_module``.
    """
    rows = _module_rows(PACKAGE, "")
    for layer in (name for row in LAYERS for name in row):
        rows.update(_module_rows(PACKAGE / layer, f"{layer}/"))
    return rows


def architecture_rows() -> List[Tuple[str, str]]:
    """The rows of ARCHITECTURE.md's "## Modules" tables, in its order; a layer's under "### `_layer/`"."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    prefix = ""
    for line in section.splitlines():
        heading = re.match(r"### `(_\w+)/`", line)
        if heading:
            prefix = heading.group(1) + "/"
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 2 and cells[0].startswith("`"):
            rows.append((cells[0].replace("`", f"`{prefix}", 1), cells[1]))
    return rows


def _table(rows: List[Tuple[str, str]]) -> List[str]:
    return [f"| {name} | {text} |" for name, text in rows]


def test_the_module_table_of_architecture_md_matches_the_package():
    written = architecture_rows()
    actual = package_rows()
    # The rows to paste: ARCHITECTURE's order for the modules it has, new modules after them.
    expected = [(name, actual[name]) for name, _ in written if name in actual]
    expected += [(name, text) for name, text in actual.items() if name not in dict(written)]
    if written == expected:
        return
    diff = difflib.unified_diff(_table(written), _table(expected), "ARCHITECTURE.md", "the package", lineterm="")
    raise AssertionError(
        "ARCHITECTURE.md's module tables differ from the modules' docstrings (a layer's rows go in its own"
        " table under ### `_layer/`, named without the layer):\n" + "\n".join(diff)
    )


def test_every_module_says_what_it_is():
    empty = [name for name, text in package_rows().items() if not text]
    assert not empty, f"modules without a docstring: {empty}"


def _layer_of(module: str) -> Optional[int]:
    """The row of ``LAYERS`` that holds ``module`` (``memshare._layer._x``), None outside the layers."""
    parts = module.split(".")
    for index, row in enumerate(LAYERS):
        if len(parts) > 1 and parts[1] in row:
            return index
    return None


def _imports(path: Path, module: str) -> List[Tuple[int, str]]:
    """(line, imported memshare module) for every import in ``path``, at any depth, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("memshare"):
                continue
            # "from .. import _compat" names a module; "from ._refs import find_backing" names a value.
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                is_module = (PACKAGE.parent / (candidate.replace(".", "/") + ".py")).exists() or (
                    PACKAGE.parent / candidate.replace(".", "/")
                ).is_dir()
                found.append((node.lineno, candidate if is_module else target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("memshare")]
    return found


def wrong_way_imports() -> List[str]:
    """Every import from a layer to one above it or to a sibling, or from a base module into the layers."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if module.endswith(".__init__"):
            module = module[: -len(".__init__")]
        top = module.split(".")[1] if "." in module else ""
        source_layer = _layer_of(module)
        for line, target in _imports(path, module):
            target_layer = _layer_of(target)
            if (module, target) in UPWARD:
                continue
            if top in BASE:
                ok = target.split(".")[1] in BASE if "." in target else False
            elif source_layer is None or target_layer is None:
                ok = source_layer is None or target.split(".")[1] in BASE or target == "memshare"
                ok = ok and not (source_layer is not None and target == "memshare")
            elif target_layer == source_layer:
                ok = target.split(".")[1] == module.split(".")[1]  # its own package, not a sibling
            else:
                ok = target_layer > source_layer
            if not ok:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {target}")
    return wrong


def test_imports_go_down_the_layers():
    wrong = wrong_way_imports()
    assert not wrong, (
        "Imports against the layer order of tests/test_architecture.py's LAYERS (a module imports its own"
        " package, the layers below and the base modules):\n" + "\n".join(wrong)
    )


def test_the_layer_check_finds_an_import_going_up(tmp_path, monkeypatch):
    """The check itself: an import upwards, one between siblings and one from a base module are each found."""
    fake = tmp_path / "memshare"
    for layer in ("_lifetime", "_parent", "_worker"):
        (fake / layer).mkdir(parents=True)
        (fake / layer / "__init__.py").write_text('"""A layer."""\n')
    (fake / "__init__.py").write_text("")
    (fake / "_config.py").write_text("from ._parent import _session\n")
    (fake / "_lifetime" / "_low.py").write_text("from .._parent._session import Session\n")
    (fake / "_parent" / "_session.py").write_text("from .._worker import _run\nfrom .._lifetime import _low\n")
    (fake / "_worker" / "_run.py").write_text("from .. import _config\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    wrong = wrong_way_imports()
    assert [line.split(": ", 1)[1] for line in wrong] == [
        "memshare._config imports memshare._parent._session",
        "memshare._lifetime._low imports memshare._parent._session",
        "memshare._parent._session imports memshare._worker._run",
    ]


def names_in_architecture_md_that_do_not_exist(text: str) -> List[str]:
    """Each dotted name in ``text`` that starts with a memshare module (``_session.Session.pack_task``) and
    does not resolve: the module imported, then each attribute in turn."""
    modules: Dict[str, str] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] != "__init__":
            modules.setdefault(parts[-1], ".".join(parts))
    missing = []
    for name in sorted(set(re.findall(r"(?<![\w./])(_[a-z]\w*(?:\.[A-Za-z_]\w*)+)", text))):
        first, *rest = name.split(".")
        if first not in modules:
            continue
        found: object = importlib.import_module(modules[first])
        for part in rest:
            if not hasattr(found, part):
                missing.append(name)
                break
            found = getattr(found, part)
    return missing


def test_every_name_architecture_md_gives_exists():
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    assert len(re.findall(r"(?<![\w./])_[a-z]\w*\.[A-Za-z_]\w*", text)) > 40  # the check reads something
    missing = names_in_architecture_md_that_do_not_exist(text)
    assert not missing, f"ARCHITECTURE.md names what the code does not have: {missing}"
    assert names_in_architecture_md_that_do_not_exist("see `_session.Session.pack_tasks` and _refs.nowhere") == [
        "_refs.nowhere",
        "_session.Session.pack_tasks",
    ]


#: A runtime module (every module but the tools') is read in one sitting: at most this many lines.
MODULE_LINES = 450
#: A class at most this many lines of code (its docstrings, numpydoc for the public API, not counted).
CLASS_CODE_LINES = 250
#: Modules and classes over the bounds today, each with its size; the list only shrinks.
OVERSIZED: Dict[str, int] = {}


def _docstring_lines(node: ast.AST) -> int:
    lines = 0
    for inner in ast.walk(node):
        if isinstance(inner, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and inner.body:
            first = inner.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    lines += first.end_lineno - first.lineno + 1
    return lines


def oversized(package: Path) -> Dict[str, int]:
    """The runtime modules over ``MODULE_LINES`` lines and classes over ``CLASS_CODE_LINES`` lines of code."""
    found: Dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if "_tools" in parts:
            continue  # the command-line tools and the benchmark harness: no runtime module imports them
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        source = path.read_text(encoding="utf-8")
        if source.count("\n") > MODULE_LINES:
            found[module] = source.count("\n")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                code = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
                if code > CLASS_CODE_LINES:
                    found[f"{module}.{node.name}"] = code
    return found


def test_modules_and_classes_are_short_enough_to_read_in_one_sitting():
    found = oversized(PACKAGE)
    grown = {name: size for name, size in found.items() if size > OVERSIZED.get(name, 0)}
    assert not grown, f"over {MODULE_LINES} lines (module) or {CLASS_CODE_LINES} lines of code (class): {grown}"
    shrunk = {name: found.get(name) for name in OVERSIZED if found.get(name) != OVERSIZED[name]}
    assert not shrunk, f"smaller than OVERSIZED says (lower its entry, or remove it): {shrunk}"


def test_the_size_check_finds_a_long_module_and_a_long_class(tmp_path):
    fake = tmp_path / "memshare"
    (fake / "_tools").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "_long.py").write_text("x = 1\n" * (MODULE_LINES + 1))
    # With its "class" line, a class of CLASS_CODE_LINES lines of code and 301 of docstring.
    body = '    """' + "doc\n" * 300 + '"""\n' + "    x = 1\n" * (CLASS_CODE_LINES - 1)
    (fake / "_classes.py").write_text(f"class Documented:\n{body}\nclass Long:\n{body}    y = 2\n")
    (fake / "_tools" / "_tool.py").write_text("x = 1\n" * (MODULE_LINES + 1))
    assert oversized(fake) == {
        "memshare._long": MODULE_LINES + 1,
        "memshare._classes": 2 * (CLASS_CODE_LINES + 301) + 2,
        "memshare._classes.Long": CLASS_CODE_LINES + 1,
    }


def class_annotations_naming_numpy(source: str) -> List[str]:
    """The class-body annotations of ``source`` that start with ``np.`` (line: annotation)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                if isinstance(statement, ast.AnnAssign) and ast.unparse(statement.annotation).startswith("np."):
                    found.append(f"{statement.lineno}: {ast.unparse(statement.annotation)}")
    return found


def test_no_class_annotation_starts_with_numpys_name():
    """numpy is imported on first use (``_numpy``); from Python 3.15, ``@dataclass`` reads the leading dotted
    name of each field's annotation, and ``np.dtype`` there would import numpy with the module."""
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in class_annotations_naming_numpy(path.read_text(encoding="utf-8"))
    ]
    assert not found, f"annotate these fields otherwise (Any, with a comment): {found}"
    assert class_annotations_naming_numpy("class A:\n    dtype: np.dtype\n") == ["2: np.dtype"]
