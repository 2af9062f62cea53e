"""memshare on joblib's bundled loky: no side effect on plain joblib, long-lived workers."""

import json
import os
import re
import signal

import pytest
from conftest import run_script, wait_until, worker_pid
from joblib.externals.loky.process_executor import BrokenProcessPool, TerminatedWorkerError

import memshare
from memshare._frontends._executor import current_executor

# Plain joblib loky calls over a 2 MB array (memmapped by joblib), then nested
# loky calls inside loky workers. It prints the pids of every process involved,
# so that their /dev/shm entries can be told from other processes'.
PLAIN_JOBLIB = """
import json, os, sys
import joblib
import numpy as np
if {import_memshare}:
    import memshare
X = np.random.rand(2 * 1024 * 1024 // 8 + 1000)

def inner(X, i):
    return os.getpid(), float(X[i::2].sum())

def outer(X, i):
    pairs = joblib.Parallel(n_jobs=2, backend="loky")(joblib.delayed(inner)(X, j) for j in range(2))
    return [os.getpid()] + [pid for pid, _ in pairs]

pids = {{os.getpid()}}
for _ in range(3):
    calls = joblib.Parallel(n_jobs=2, backend="loky")(joblib.delayed(inner)(X, i) for i in range(4))
    pids.update(pid for pid, _ in calls)
for nested in joblib.Parallel(n_jobs=2, backend="loky")(joblib.delayed(outer)(X, i) for i in range(2)):
    pids.update(nested)
print(json.dumps(sorted(pids)))
"""


def _owned_by(entry: str, pids) -> bool:
    """True when a joblib folder or loky semaphore name carries one of ``pids``."""
    return any(re.search(rf"(^|[_-]){pid}([_-]|$)", entry) for pid in pids)


def _run_plain_joblib(import_memshare: bool):
    before = set(os.listdir("/dev/shm"))
    result = run_script(PLAIN_JOBLIB.format(import_memshare=import_memshare))
    pids = json.loads(result.stdout)
    # joblib removes its folders and semaphores as the script exits; the
    # resource tracker may finish a moment later.
    wait_until(lambda: not [e for e in set(os.listdir("/dev/shm")) - before if _owned_by(e, pids)], timeout=10)
    left = sorted(e for e in set(os.listdir("/dev/shm")) - before if _owned_by(e, pids))
    return result.stderr, left


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="joblib memmaps into /dev/shm only where it exists")
def test_importing_memshare_changes_nothing_for_plain_joblib():
    plain_stderr, plain_left = _run_plain_joblib(import_memshare=False)
    stderr, left = _run_plain_joblib(import_memshare=True)
    assert stderr == plain_stderr == "", stderr
    assert left == plain_left == [], left


def test_importing_memshare_does_not_import_standalone_loky():
    result = run_script("import sys, memshare; print('loky' in sys.modules)")
    assert result.stdout.strip() == "False"


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def test_worker_died_error_is_joblib_loky_terminated_worker_error():
    assert issubclass(memshare.WorkerDiedError, TerminatedWorkerError)
    with pytest.raises(TerminatedWorkerError, match="SIGKILL"):
        memshare.Parallel(n_jobs=2)(memshare.delayed(kill_self)() for _ in range(2))


def rendezvous(folder: str, parties: int = 2) -> int:
    """Wait until ``parties`` workers have arrived here; return this worker's pid.

    With as many tasks as workers, every worker runs exactly one of them.
    """
    open(os.path.join(folder, str(os.getpid())), "w").close()
    if not wait_until(lambda: len(os.listdir(folder)) >= parties, timeout=60):
        raise TimeoutError(f"only {os.listdir(folder)} arrived")
    return os.getpid()


def each_worker_pid(call, folder) -> set:
    """The pids of all of the call's 2 workers, each running one task."""
    os.makedirs(folder)
    return set(call(delayed_rendezvous(folder) for _ in range(2)))


def delayed_rendezvous(folder):
    return memshare.delayed(rendezvous)(str(folder))


def test_memshare_and_plain_joblib_calls_keep_their_own_workers(tmp_path):
    """Alternating with plain joblib loky calls never restarts memshare's workers."""
    import joblib

    first = each_worker_pid(memshare.Parallel(n_jobs=2, batch_size=1), tmp_path / "first")
    for round in range(2):
        plain = each_worker_pid(joblib.Parallel(n_jobs=2, backend="loky", batch_size=1), tmp_path / f"plain{round}")
        again = each_worker_pid(memshare.Parallel(n_jobs=2, batch_size=1), tmp_path / f"again{round}")
        assert again == first and not plain & first, (first, plain, again)


def test_worker_killed_while_idle_does_not_fail_the_next_call():
    pids = set(memshare.Parallel(n_jobs=2)(memshare.delayed(worker_pid)(i) for i in range(8)))
    executor = current_executor()
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)
    # Once loky has noticed the death, the executor refuses work; a call
    # starting before that would share the fate of any task sent to a dying
    # worker, as with joblib's own loky backend.
    assert wait_until(lambda: _refuses_work(executor), timeout=30)
    results = memshare.Parallel(n_jobs=2)(memshare.delayed(worker_pid)(i) for i in range(8))
    assert victim not in results and current_executor() is not executor


def _refuses_work(executor) -> bool:
    try:
        executor.submit(int)
    except BrokenProcessPool:
        return True
    return False


# Workers warmed on tiny tasks (loky measures each worker's reference RSS
# after its first task), then tasks that each read a 400 MB shared array and
# wait out loky's check delay, so that each worker runs loky's leak check
# with the array's pages counted in its RSS.
LEAK_CHECK = """
import json, os, sys, time, warnings
warnings.simplefilter("always", UserWarning)  # loky warns when it replaces a worker
sys.path.insert(0, {tests!r})
import memshare
from joblib.externals.loky import process_executor
from test_loky import rendezvous

def read_all(X, folder):
    total = float(X.sum())  # maps and touches every page
    # loky checks a worker's RSS after a task when a second has passed since
    # its last check: waiting here makes this task's end such a check.
    time.sleep(process_executor._MEMORY_LEAK_CHECK_DELAY + 0.2)
    return rendezvous(folder), total

def each_worker(name, func, *args):
    folder = os.path.join({folder!r}, name)
    os.mkdir(folder)
    calls = memshare.Parallel(n_jobs=2, batch_size=1)(memshare.delayed(func)(*args, folder) for _ in range(2))
    return sorted(p if isinstance(p, int) else p[0] for p in calls)

X = memshare.zeros(400 * 1024 * 1024 // 8)
warm = each_worker("warm", rendezvous)  # loky's reference RSS is taken after a worker's first task
big = each_worker("big", read_all, X)
del X
after = each_worker("after", rendezvous)
print(json.dumps({{"warm": warm, "big": big, "after": after}}))
"""


def test_workers_mapping_more_than_loky_leak_limit_are_not_recycled(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    script = LEAK_CHECK.format(tests=tests, folder=str(tmp_path))
    result = run_script(script, env={"LOKY_MAX_MEMORY_LEAK_SIZE": ""}, timeout=180)
    pids = json.loads(result.stdout)
    assert result.stderr == "", result.stderr
    assert len(pids["warm"]) == 2, pids
    assert pids["big"] == pids["warm"] == pids["after"], pids


FORKED_CHILD = """
import json, os, sys
sys.path.insert(0, {tests!r})
import memshare
from test_loky import rendezvous

def workers(name):
    folder = os.path.join({folder!r}, name)
    os.mkdir(folder)
    calls = memshare.Parallel(n_jobs=2, batch_size=1)(memshare.delayed(rendezvous)(folder) for _ in range(2))
    return sorted(calls)

before = workers("before")
read_end, write_end = os.pipe()
child = os.fork()
if child == 0:
    os.close(read_end)
    os.write(write_end, json.dumps(workers("child")).encode())
    os._exit(0)
os.close(write_end)
with os.fdopen(read_end) as pipe:
    in_child = json.loads(pipe.read())
os.waitpid(child, 0)
print(json.dumps({{"before": before, "child": in_child, "after": workers("after")}}))
"""


def test_forked_child_runs_calls_on_workers_of_its_own(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    pids = json.loads(run_script(FORKED_CHILD.format(tests=tests, folder=str(tmp_path)), timeout=120).stdout)
    assert len(pids["child"]) == 2 and not set(pids["child"]) & set(pids["before"]), pids
    assert pids["after"] == pids["before"], pids
