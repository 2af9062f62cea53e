"""Functions of ``__main__`` go by name to pool workers that run the main script, and by value otherwise.

The decision (``_main_functions``) is tested in this process on a script loaded as a stand-in ``__main__``;
the end-to-end tests run scripts in fresh interpreters and tell by name from by value by the size of the
pickled tasks, which the pool's session counts.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import types

import pytest

from memshare._payload._main_functions import MainFunctions
from memshare._payload._main_script import module_bindings
from memshare._payload._main_values import MainFunction

SCRIPT = textwrap.dedent(
    """
    import math
    import os.path
    from os.path import join

    import numpy as np

    LIMIT = 3
    NAMES = ("a", "b")
    DATA = [1, 2]
    CHANGED = 5
    SET_LATER = None

    def plain(x):
        return x + 1

    def reads_literals(x):
        return x + LIMIT + len(NAMES)

    def reads_a_list(x):
        return x + len(DATA)

    def reads_a_global_the_guard_rebinds(x):
        return x + CHANGED

    def calls_others(x):
        return plain(x) * math.pi + np.sum(x) + len(os.path.sep) + len(join("a", "b"))

    def literal_defaults(x, k=2, *, j=(1, "a"), n=None):
        return x * k

    def a_list_default(x, k=[]):
        return x

    def assigns_a_global(x):
        global SET_LATER
        SET_LATER = x

    def reads_its_module_name(x):
        return __name__

    def reads_a_name_the_guard_defines(x):
        return defined_under_the_guard(x)

    def rebound(x):
        return x

    rebound = rebound

    def decorate(func):
        return func

    @decorate
    def decorated(x):
        return x

    def evaluates(x):
        return eval("x")

    def with_an_attribute(x):
        return x

    with_an_attribute.tag = 1

    def calls_a_function_that_cannot(x):
        return reads_a_list(x)

    def reads_a_class(x):
        return Point(x)

    class Point:
        def __init__(self, x):
            self.x = x

    anonymous = lambda x: x  # noqa: E731

    if __name__ == "__main__":
        CHANGED = 6

        def defined_under_the_guard(x):
            return x
    """
)

BY_NAME = {"plain", "reads_literals", "calls_others", "literal_defaults", "decorate"}


@pytest.fixture
def script_main(tmp_path, monkeypatch):
    """SCRIPT run from a file as ``__main__`` of this process (restored afterwards)."""
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    module = types.ModuleType("__main__")
    module.__file__ = str(path)
    exec(compile(SCRIPT, str(path), "exec", dont_inherit=True), module.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", module)
    return module


def _functions(module):
    return {name: value for name, value in vars(module).items() if isinstance(value, types.FunctionType)}


def test_only_top_level_functions_that_behave_alike_in_the_workers_go_by_name(script_main):
    functions = MainFunctions("forkserver")
    decided = {name: type(functions.sent_as(func)) is MainFunction for name, func in _functions(script_main).items()}
    assert {name for name, by_name in decided.items() if by_name} == BY_NAME
    assert "defined_under_the_guard" in decided and "anonymous" in decided  # decided, by value


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_start_methods_whose_workers_run_the_main_script(script_main, method):
    assert type(MainFunctions(method).sent_as(script_main.plain)) is MainFunction


def test_forked_workers_get_by_name_what_is_unchanged_since_they_forked(script_main):
    # A forked worker has the parent's __main__ as it was when the pool started, file or not.
    functions = MainFunctions("fork")
    assert type(functions.sent_as(script_main.plain)) is MainFunction
    assert type(functions.sent_as(script_main.reads_literals)) is MainFunction
    assert type(functions.sent_as(script_main.defined_under_the_guard)) is MainFunction
    assert functions.sent_as(script_main.reads_a_list) is script_main.reads_a_list  # a list may have changed
    script_main.LIMIT = 4  # after the workers forked: theirs is still 3
    assert functions.sent_as(script_main.reads_literals) is script_main.reads_literals
    exec("def made_later(x):\n    return x\n", vars(script_main))  # after the workers forked: they lack it
    assert functions.sent_as(script_main.made_later) is script_main.made_later
    assert type(MainFunctions("fork").sent_as(script_main.made_later)) is MainFunction  # a pool started now


@pytest.mark.parametrize("path", ["<stdin>", None])
def test_a_main_without_a_file_sends_by_value(script_main, monkeypatch, path):
    if path is None:
        monkeypatch.delattr(script_main, "__file__")
    else:
        monkeypatch.setattr(script_main, "__file__", path)
    functions = MainFunctions("forkserver")
    assert not functions.enabled
    assert functions.sent_as(script_main.plain) is script_main.plain


def test_the_decision_is_checked_again_before_each_task(script_main):
    functions = MainFunctions("forkserver")
    assert type(functions.sent_as(script_main.reads_literals)) is MainFunction
    script_main.LIMIT = 4  # the parent changed a constant: the worker's would still be 3
    assert functions.sent_as(script_main.reads_literals) is script_main.reads_literals
    assert type(functions.sent_as(script_main.plain)) is MainFunction
    script_main.plain.__defaults__ = (1,)
    assert functions.sent_as(script_main.plain) is script_main.plain
    assert type(functions.sent_as(script_main.literal_defaults)) is MainFunction
    script_main.literal_defaults.__code__ = script_main.rebound.__code__
    assert functions.sent_as(script_main.literal_defaults) is script_main.literal_defaults


def test_a_script_edited_since_the_parent_ran_it_sends_by_value(script_main):
    path = script_main.__file__
    with open(path, "a") as script:
        script.write("\n\ndef plain(x):\n    return x + 2\n")
    assert MainFunctions("forkserver").sent_as(script_main.plain) is script_main.plain


def test_a_function_goes_as_its_name_and_comes_back_as_the_workers_own(script_main):
    stand_in = MainFunctions("spawn").sent_as(script_main.plain)
    stream = pickle.dumps(stand_in, protocol=5)
    assert b"plain" in stream and len(stream) < 100
    assert pickle.loads(stream) is script_main.plain  # this process's __main__ stands for the worker's
    assert stand_in(1) == 2 and stand_in.__qualname__ == "plain"


def test_bindings_are_counted_wherever_the_module_binds_a_name():
    import ast

    bindings = module_bindings(
        ast.parse(
            textwrap.dedent(
                """
                import a.b
                import c as d
                from e import f
                def g(): pass
                for h in []: pass
                with open("x") as i: pass
                try: pass
                except Exception as j: pass
                if (k := 1): pass
                def inner():
                    global l
                    local = 1
                [m for m in []]
                del g
                """
            )
        )
    )
    assert bindings.count == {name: 1 for name in "adfhijklm"} | {"g": 2, "inner": 1}
    assert bindings.imports == {"a": [("module", "a")], "d": [("module", "c")], "f": [("from", "e", "f")]}
    assert not bindings.star_import
    assert module_bindings(ast.parse("from os import *")).star_import


POOL_SCRIPT = textwrap.dedent(
    """
    import sys

    from memshare import MemmappingPool

    OFFSET = 1
    DATA = []

    def plus_one(x):
        return x + 1

    def plus_offset(x):
        return x + OFFSET

    def plus_data(x):
        return x + len(DATA)

    def plus_hundred(x):
        return x + 100

    def replaced(x):
        return x + 1

    def fails(x):
        raise ValueError(f"no {x}")

    if __name__ == "__main__":
        OFFSET = 10  # the parent's value reaches the tasks, as by value
        DATA.append(5)
        replaced.__code__ = plus_hundred.__code__  # the parent's code runs, not the script's

        def guarded(x):
            return x * 2

        with MemmappingPool(2, context=sys.argv[1], maxtasksperchild=3) as pool:
            for name, func in [("plus_one", plus_one), ("plus_offset", plus_offset), ("plus_data", plus_data),
                               ("replaced", replaced), ("guarded", guarded), ("lambda", lambda x: x - 1)]:
                before = pool._session.stats.as_dict()
                values = [pool.apply(func, (i,)) for i in range(3)] + list(pool.imap(func, range(3)))
                after = pool._session.stats.as_dict()
                per_task = (after["bytes_pickled"] - before["bytes_pickled"]) / (after["tasks"] - before["tasks"])
                # Flushed at once: a worker forked later (maxtasksperchild) would flush a copy of the buffer.
                print(name, values, "by name" if per_task < 150 else "by value", flush=True)
            try:
                pool.apply(fails, (7,))
            except ValueError as exc:
                print("error", exc, flush=True)
    """
)

POOL_EXPECTED = """\
plus_one [1, 2, 3, 1, 2, 3] by name
plus_offset [10, 11, 12, 10, 11, 12] by value
plus_data [1, 2, 3, 1, 2, 3] by value
replaced [100, 101, 102, 100, 101, 102] by value
guarded [0, 2, 4, 0, 2, 4] by value
lambda [-1, 0, 1, -1, 0, 1] by value
error no 7
"""


# Forked workers have the parent's __main__ as it was when the pool started: OFFSET is 10 there too, the
# replaced code and the function of the guard are there, DATA is a list that may have changed since.
POOL_EXPECTED_FORK = """\
plus_one [1, 2, 3, 1, 2, 3] by name
plus_offset [10, 11, 12, 10, 11, 12] by name
plus_data [1, 2, 3, 1, 2, 3] by value
replaced [100, 101, 102, 100, 101, 102] by name
guarded [0, 2, 4, 0, 2, 4] by name
lambda [-1, 0, 1, -1, 0, 1] by value
error no 7
"""


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_a_pool_in_a_script_sends_top_level_functions_by_name_where_its_workers_run_the_script(tmp_path, method):
    script = tmp_path / "pool_script.py"
    script.write_text(POOL_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), method], capture_output=True, text=True, timeout=180, cwd=tmp_path, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == (POOL_EXPECTED if method != "fork" else POOL_EXPECTED_FORK)
