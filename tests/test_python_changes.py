"""What changed under memshare in Python 3.14-3.15 and NumPy 2.4-2.5, each where it touches memshare."""

import json
import sys

import pytest
from conftest import run_script

from memshare import _compat

LINUX = sys.platform.startswith("linux")


def test_a_deprecation_warning_raised_from_memshare_code_fails_the_suite():
    """pyproject.toml's filter: a DeprecationWarning attributed to a memshare module is an error, others are not."""
    code = compile("import warnings\nwarnings.warn('going away', DeprecationWarning)", "<memshare code>", "exec")
    with pytest.raises(DeprecationWarning, match="going away"):
        exec(code, {"__name__": "memshare._somewhere"})
    with pytest.warns(DeprecationWarning, match="going away"):
        exec(code, {"__name__": "another_library"})


def test_numpy_deprecations_met_by_memshare_code_are_errors():
    """NumPy 2.4 deprecates setting an array's strides (2.5 its shape); the warning names the caller's module."""
    np = pytest.importorskip("numpy")
    code = compile("array.strides = (8,)", "<memshare code>", "exec")
    if tuple(int(part) for part in np.__version__.split(".")[:2]) >= (2, 4):
        with pytest.raises(DeprecationWarning, match="strides"):
            exec(code, {"__name__": "memshare._somewhere", "array": np.zeros(4)})
    else:  # no deprecation to meet
        exec(code, {"__name__": "memshare._somewhere", "array": np.zeros(4)})


PRELOAD = """
import inspect, json
import multiprocessing.forkserver as forkserver
from memshare import _compat

takes_on_error = "on_error" in inspect.signature(forkserver.set_forkserver_preload).parameters
forkserver.set_forkserver_preload(["json"], **({"on_error": "fail"} if takes_on_error else {}))
_compat.preload_in_fork_server("memshare")
server = forkserver._forkserver
print(json.dumps([server._preload_modules, getattr(server, "_preload_on_error", None), takes_on_error]))
"""


@pytest.mark.skipif(not LINUX, reason="the fork server is tested on Linux")
def test_preloading_memshare_keeps_the_users_modules_and_on_error():
    """3.15's set_forkserver_preload(on_error=...) resets on_error when not given: memshare passes the user's on.

    In a fresh interpreter, whose fork server has not started (the list matters only until it does).
    """
    modules, on_error, takes_on_error = json.loads(run_script(PRELOAD).stdout)
    assert modules == ["json", "memshare"]
    assert on_error == ("fail" if takes_on_error else None)


def test_memshare_pickles_with_protocol_5_whatever_the_default():
    """Python 3.14 made protocol 5 the default; memshare names it (out-of-band buffers need it) on every Python."""
    from memshare._payload import _plain

    for value in (b"x" * 10, [1, 2.5, "three"], {"a": (1, None)}):
        assert _plain.plain_stream(value)[:2] == b"\x80\x05"


RAW_FORK = """
import os, sys
import numpy as np
import memshare

def total(a):
    return float(a.sum())

x = np.ones(4 * 1024**2 // 8)
read_end, write_end = os.pipe()
child = os.fork()  # a raw fork: from 3.14.5 the child closes the resource tracker's descriptor
if child == 0:
    os.close(read_end)
    try:
        calls = memshare.Parallel(n_jobs=2)(memshare.delayed(total)(x) for _ in range(2))
        with memshare.MemmappingPool(2) as pool:
            mapped = pool.map(total, [x, x])
        answer = "ok" if calls == mapped == [x.size] * 2 else f"wrong {{calls}} {{mapped}}"
    except BaseException as exc:
        answer = f"failed {{exc!r}}"
    os.write(write_end, answer.encode())
    os._exit(0)
os.close(write_end)
with os.fdopen(read_end) as pipe:
    answer = pipe.read()
os.waitpid(child, 0)
print(answer)
"""


@pytest.mark.skipif(not LINUX, reason="os.fork() with memshare's workers is tested on Linux")
def test_a_raw_forked_child_runs_a_call_and_a_pool_quietly():
    """A child of os.fork() (not multiprocessing's) starts workers of its own, and no tracker fails.

    From 3.14.5 the child closes the resource tracker's descriptor, and its
    workers' semaphores go to a tracker of its own. A child that leaves by
    ``os._exit()`` leaves those to the tracker, which warns about them on any
    Python: only errors count here (a tracker reading a message it does not
    understand fails with a traceback).
    """
    result = run_script(RAW_FORK.format(), timeout=180)
    assert result.stdout.strip() == "ok", result
    for error in ("Traceback", "KeyError", "ValueError"):
        assert error not in result.stderr, result.stderr


def test_every_private_name_is_checked_on_this_python():
    """Each private name memshare uses has a check in _compat, run here: 3.14 and 3.15 included."""
    missing = [check.name for check in _compat.failed_checks()]
    assert not missing, missing
    names = " ".join(check.name for check in _compat.CHECKS)
    for name in ("_preload_modules", "_forkserver_pid", "_at_fork_reinit", "_setup_queues", "_get_sentinels"):
        assert name in names, name
