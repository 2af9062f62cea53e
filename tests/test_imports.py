"""What ``import memshare`` and a ``MemmappingPool`` import: no joblib or loky unless joblib is used, no numpy early.

Each case runs in a fresh interpreter, since this one has imported joblib already.
"""

import json

import pytest
from conftest import run_script

#: Modules a pool of plain objects needs in neither process.
NOT_FOR_A_POOL = ("joblib", "joblib.externals.loky", "pandas", "pyarrow", "scipy", "numpy")

POOL_SCRIPT = f"""
import json, sys
import memshare

def imported(_):
    import sys
    return [name for name in {NOT_FOR_A_POOL!r} if name in sys.modules]

with memshare.MemmappingPool(2, context=sys.argv[1]) as pool:
    workers = pool.map(imported, range(4), chunksize=1)
print(json.dumps({{"workers": workers, "parent": imported(None)}}))
"""


@pytest.mark.parametrize("method", ["forkserver", "fork", "spawn"])
def test_a_pool_and_its_workers_import_no_joblib(shm_dir, method):
    """``import memshare`` and a pool's first map of plain objects import neither joblib, loky nor numpy."""
    code = POOL_SCRIPT.replace("sys.argv[1]", repr(method))
    seen = json.loads(run_script(code).stdout.strip().splitlines()[-1])
    assert seen == {"workers": [[], [], [], []], "parent": []}


def test_no_module_of_the_runtime_imports_numpy_at_import(shm_dir):
    """Every module outside the joblib side and the tools loads without numpy: it is imported on first use."""
    code = """
import importlib, json, pkgutil, sys
import memshare
joblib_side = ("memshare.backend", "memshare.parallel", "memshare._frontends._executor", "memshare.__main__")
names = [m.name for m in pkgutil.walk_packages(memshare.__path__, "memshare.")]
names = [name for name in names if name not in joblib_side and not name.startswith("memshare._tools")]
for name in names:
    importlib.import_module(name)
print(json.dumps([len(names), "numpy" in sys.modules, "joblib" in sys.modules]))
"""
    count, numpy_imported, joblib_imported = json.loads(run_script(code).stdout.strip().splitlines()[-1])
    assert count > 60 and not numpy_imported and not joblib_imported


def test_an_array_made_while_a_task_is_pickled_still_goes_to_shared_memory(shm_dir):
    """numpy imported by an argument's ``__reduce__`` while it is pickled: its array is dumped all the same."""
    code = """
import json, sys
import memshare

class MakesAnArray:
    def __reduce__(self):
        import numpy
        return (numpy.asarray, (numpy.ones(100_000),))

def total(array):
    return float(array.sum())

with memshare.MemmappingPool(1, context="fork", max_nbytes=1000) as pool:
    assert "numpy" not in sys.modules
    value = pool.apply(total, (MakesAnArray(),))
stats = memshare.last_call_stats()
print(json.dumps([value, stats["arrays_dumped"] + stats["arrays_held_once"], stats["bytes_pickled"]]))
"""
    value, in_shared_memory, bytes_pickled = json.loads(run_script(code).stdout.strip().splitlines()[-1])
    assert (value, in_shared_memory) == (100_000.0, 1) and bytes_pickled < 10_000  # the array's 800 kB are not


NUMPY_SCRIPT = """
import sys
import memshare

def numpy_in(_):
    import sys
    return "numpy" in sys.modules

def total(array):
    return float(array.sum())

if sys.argv[1] == "numpy first":
    import numpy
with memshare.MemmappingPool(2, context="forkserver", max_nbytes=1000) as pool:
    before = pool.map(numpy_in, range(2), chunksize=1)
    import numpy as np
    arrays = [np.full(10_000, i, dtype=np.float64) for i in range(4)]  # shared: over max_nbytes
    totals = pool.map(total, arrays, chunksize=1)
    doubled = pool.starmap(np.add, zip(arrays, arrays))  # results over max_nbytes: files
print(before, totals, [float(a[0]) for a in doubled])
"""


@pytest.mark.parametrize("first", ["numpy first", "numpy later"])
def test_the_fork_server_has_numpy_when_the_parent_had_it(shm_dir, first):
    """The server preloads numpy for a parent that has it; without it, workers import numpy with their first array."""
    result = run_script(NUMPY_SCRIPT.replace("sys.argv[1]", repr(first)))
    preloaded = first == "numpy first"
    assert result.stdout.split("\n")[-2] == f"{[preloaded] * 2} [0.0, 10000.0, 20000.0, 30000.0] [0.0, 2.0, 4.0, 6.0]"


@pytest.mark.parametrize("joblib_first", [True, False], ids=["joblib-first", "memshare-first"])
def test_the_backend_is_registered_whichever_is_imported_first(shm_dir, joblib_first):
    imports = "import joblib\nimport memshare" if joblib_first else "import memshare\nimport joblib"
    code = f"""
{imports}
import numpy as np
from joblib.parallel import BACKENDS
assert "memshare" in BACKENDS, sorted(BACKENDS)
assert joblib.__spec__.loader is joblib.__loader__ and type(joblib.__loader__).__module__ != "memshare._registration"
with joblib.parallel_config(backend="memshare", n_jobs=2):
    assert joblib.Parallel()(joblib.delayed(np.sum)(np.ones(10)) for _ in range(3)) == [10.0] * 3
print("ok")
"""
    assert run_script(code).stdout.strip().endswith("ok")


def test_the_backend_is_registered_when_only_a_joblib_submodule_is_imported(shm_dir):
    code = """
import memshare
from joblib.parallel import BACKENDS
assert "memshare" in BACKENDS, sorted(BACKENDS)
print("ok")
"""
    assert run_script(code).stdout.strip().endswith("ok")


def test_worker_died_error_is_lokys_error_and_one_class(shm_dir):
    code = """
import pickle, sys
import memshare
assert "joblib" not in sys.modules
from memshare import WorkerDiedError
from memshare._errors import WorkerDiedError as same
from joblib.externals.loky.process_executor import TerminatedWorkerError
assert same is WorkerDiedError is memshare.WorkerDiedError
assert issubclass(WorkerDiedError, TerminatedWorkerError) and WorkerDiedError.__module__ == "memshare._errors"
assert type(pickle.loads(pickle.dumps(WorkerDiedError("gone")))) is WorkerDiedError
assert "WorkerDiedError" in dir(memshare) and "Parallel" in dir(memshare)
print("ok")
"""
    assert run_script(code).stdout.strip().endswith("ok")


def test_a_failed_import_of_joblib_leaves_the_registration_waiting(shm_dir):
    code = """
import sys
import memshare
sys.modules["joblib.parallel"] = None  # joblib's __init__ fails to import it
try:
    import joblib
except ImportError:
    pass
else:
    raise AssertionError("joblib imported")
for name in [name for name in sys.modules if name == "joblib" or name.startswith("joblib.")]:
    del sys.modules[name]
import joblib
assert "memshare" in joblib.parallel.BACKENDS, sorted(joblib.parallel.BACKENDS)
print("ok")
"""
    assert run_script(code).stdout.strip().endswith("ok")


@pytest.mark.parametrize("first", ["memshare.backend", "memshare.parallel"])
def test_the_backend_is_registered_when_a_module_that_imports_joblib_comes_first(shm_dir, first):
    # Importing memshare.backend loads memshare's __init__ (which waits for joblib), then joblib, whose
    # registration hook runs while memshare.backend is still half made.
    code = f"""
import warnings
warnings.simplefilter("error", RuntimeWarning)  # "could not register its joblib backend"
import {first}
import joblib
with joblib.parallel_config(backend="memshare"):
    print(joblib.Parallel(n_jobs=2)(joblib.delayed(abs)(-i) for i in range(3)))
"""
    result = run_script(code)
    assert result.stdout.strip().endswith("[0, 1, 2]"), result.stdout + result.stderr


WORKER_SCRIPT = """
import json, sys
import memshare

def parents_side(_):
    import sys
    # memshare.backend is imported in the backend's workers: joblib sends the backend along with every batch.
    prefixes = ("memshare._parent", "memshare._frontends", "memshare.pool", "memshare.parallel")
    return sorted(name for name in sys.modules if name.startswith(prefixes))

if sys.argv[1] == "Parallel":
    workers = memshare.Parallel(n_jobs=2)(memshare.delayed(parents_side)(i) for i in range(4))
else:
    with memshare.MemmappingPool(2, context=sys.argv[1]) as pool:
        workers = pool.map(parents_side, range(4), chunksize=1)
print(json.dumps(workers))
"""


@pytest.mark.parametrize("how", ["Parallel", "forkserver", "spawn"])
def test_workers_import_nothing_of_the_parents_side(shm_dir, how):
    """A worker imports what runs in it: no session, dump table, feed or front end (a fork inherits them)."""
    code = WORKER_SCRIPT.replace("sys.argv[1]", repr(how))
    workers = json.loads(run_script(code).stdout.strip().splitlines()[-1])
    assert workers == [[], [], [], []]
