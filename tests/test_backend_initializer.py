"""joblib's ``initializer``/``initargs`` run in every memshare worker, as with joblib's loky backend."""

import inspect
import os
import signal

import joblib
import pytest
from conftest import run_script, wait_until

import memshare
from memshare._frontends._executor import current_executor

pytestmark = pytest.mark.skipif(
    "initializer" not in inspect.signature(joblib.externals.loky.ProcessPoolExecutor).parameters
    or not hasattr(joblib, "parallel_config"),
    reason="this joblib does not pass an initializer to its backends",
)

# joblib.Parallel takes initializer= from joblib 1.5 on; parallel_config passes it to the backend in every version.
_parallel_takes_initializer = pytest.mark.skipif(
    tuple(int(part) for part in joblib.__version__.split(".")[:2]) < (1, 5),
    reason="joblib.Parallel takes initializer= from joblib 1.5 on (parallel_config works before)",
)

memshare.register_backend()

_TAG = "MEMSHARE_TEST_INIT_TAG"


def set_tag(value):
    os.environ[_TAG] = value


def set_other_tag():
    os.environ[_TAG] = "other"


def pid_and_tag(_):
    return os.getpid(), os.environ.get(_TAG)


def _run(n_tasks=8, **kwargs):
    return joblib.Parallel(n_jobs=2, backend="memshare", **kwargs)(
        joblib.delayed(pid_and_tag)(i) for i in range(n_tasks)
    )


@_parallel_takes_initializer
def test_initializer_runs_with_initargs_in_every_worker():
    results = _run(initializer=set_tag, initargs=("first",))
    assert {tag for _, tag in results} == {"first"}
    assert os.environ.get(_TAG) is None  # not run in the parent


def test_parallel_config_initializer_reaches_workers():
    with joblib.parallel_config(backend="memshare", initializer=set_tag, initargs=("from-config",)):
        results = joblib.Parallel(n_jobs=2)(joblib.delayed(pid_and_tag)(i) for i in range(4))
    assert {tag for _, tag in results} == {"from-config"}


@_parallel_takes_initializer
def test_same_initializer_reuses_workers_and_another_replaces_them():
    _run(initializer=set_tag, initargs=("reuse",))
    executor = current_executor()
    workers = set(executor._processes)
    second = _run(initializer=set_tag, initargs=("reuse",))
    assert current_executor() is executor
    assert {tag for _, tag in second} == {"reuse"}
    assert {pid for pid, _ in second} <= workers
    third = _run(initializer=set_other_tag)
    assert current_executor() is not executor
    assert {tag for _, tag in third} == {"other"}


@_parallel_takes_initializer
def test_worker_killed_is_replaced_by_one_that_ran_the_initializer():
    _run(initializer=set_tag, initargs=("survivor",))
    executor = current_executor()
    victim = next(iter(executor._processes))
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: victim not in executor._processes, timeout=60)
    results = _run(initializer=set_tag, initargs=("survivor",))
    assert victim not in {pid for pid, _ in results}
    assert {tag for _, tag in results} == {"survivor"}


@_parallel_takes_initializer
def test_lambda_initializer_from_main_travels_by_value():
    run_script(
        """
import os, joblib, memshare
memshare.register_backend()
def read(_):
    return os.environ.get("MEMSHARE_TEST_INIT_TAG")
if __name__ == "__main__":
    out = joblib.Parallel(n_jobs=2, backend="memshare",
                          initializer=lambda v: os.environ.__setitem__("MEMSHARE_TEST_INIT_TAG", v),
                          initargs=("lambda",))(joblib.delayed(read)(i) for i in range(4))
    assert set(out) == {"lambda"}, out
"""
    )


def test_non_callable_initializer_is_refused():
    with pytest.raises(TypeError, match="initializer must be a callable"):
        with joblib.parallel_config(backend="memshare", initializer="not a function"):
            joblib.Parallel(n_jobs=2)(joblib.delayed(pid_and_tag)(i) for i in range(2))
