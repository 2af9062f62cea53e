"""The "memshare" joblib backend and memshare.Parallel, with joblib's semantics."""

import contextlib
import multiprocessing
import os
import re
import threading
import time

import joblib
import numpy as np
import psutil
import pytest
from conftest import RETURN_AS, files_under, memshare_entries, run_script, total, wait_until, worker_pid

import memshare
from memshare import Parallel, delayed


class CustomError(Exception):
    pass


def square(x):
    return x * x


def kind(x):
    return type(x).__name__


def fail(exc):
    raise exc


def slow(x, seconds):
    time.sleep(seconds)
    return x


def nested(n):
    return Parallel(n_jobs=2)(delayed(square)(i) for i in range(n))


@pytest.mark.parametrize("n_jobs", [1, 2, -1, -2])
@pytest.mark.parametrize("verbose", [0, 60])
def test_results_equal_the_list_comprehension(n_jobs, verbose, capsys):
    assert Parallel(n_jobs=n_jobs, verbose=verbose)(delayed(square)(i) for i in range(20)) == [i * i for i in range(20)]
    printed = capsys.readouterr()  # joblib reports on stdout from verbose=50 on, on stderr below
    # joblib 1.3 ends a sequential call's report with "Done 20 tasks", later versions with "Done 20 out of 20".
    finished = re.search(r"Done +20 (out of +20 .* finished|tasks)", printed.out + printed.err)
    assert bool(finished) == bool(verbose)  # joblib's progress report, only when asked for


def test_lambdas_kwargs_and_large_arrays(shm_dir):
    data = np.arange(500_000.0)
    out = Parallel(n_jobs=2)(delayed(lambda x, k=0: (kind(x), total(x) + k))(data, k=i) for i in range(4))
    assert out == [("memmap", data.sum() + i) for i in range(4)]
    assert memshare.last_call_stats()["arrays_dumped"] == 1
    assert memshare_entries(shm_dir) == []  # unmanaged call leaves nothing


@pytest.mark.parametrize("n_jobs", [0, "two", -0])
def test_invalid_n_jobs(n_jobs):
    with pytest.raises(ValueError, match="n_jobs"):
        Parallel(n_jobs=n_jobs, backend="memshare")(delayed(square)(1) for _ in range(2))


def test_invalid_batch_size_and_backend_names():
    with pytest.raises(ValueError, match="batch_size"):
        Parallel(n_jobs=2, batch_size=0)
    with pytest.raises(ValueError, match="Invalid backend"):
        Parallel(n_jobs=2, backend="no-such-backend")
    with pytest.raises(ValueError, match="mmap_mode"):
        Parallel(n_jobs=2, mmap_mode=None)(delayed(square)(1) for _ in range(2))


@pytest.mark.parametrize("exc", [CustomError("boom"), ZeroDivisionError("zero"), KeyboardInterrupt()])
def test_exceptions_keep_their_type(exc):
    with pytest.raises(type(exc)):
        Parallel(n_jobs=2)(delayed(fail)(exc) for _ in range(3))


@pytest.mark.parametrize("exc", [CustomError("boom"), ZeroDivisionError("zero")])
def test_managed_context_stays_usable_after_an_error(exc):
    with Parallel(n_jobs=2) as parallel:
        with pytest.raises(type(exc)):
            parallel(delayed(fail)(exc) for _ in range(3))
        assert parallel(delayed(square)(i) for i in range(3)) == [0, 1, 4]


def fail_after_the_first(i):
    if i >= 1:
        raise CustomError(f"task {i}")
    return i


def test_a_managed_call_never_runs_tasks_left_over_by_a_failed_call():
    """joblib splits tasks into batches ahead of dispatch; a failed call leaves the rest queued on the Parallel.

    With one task dispatched ahead and batches of one, the first task's success makes joblib queue tasks 1
    and 2 and dispatch 1; task 1 fails, so task 2 stays queued, deterministically.
    """
    with Parallel(n_jobs=2, pre_dispatch=1, batch_size=1) as parallel:
        with pytest.raises(CustomError, match="task 1"):
            parallel(delayed(fail_after_the_first)(i) for i in range(3))
        assert parallel(delayed(square)(i) for i in range(3)) == [0, 1, 4]


def wait_for(flag: str) -> None:
    if not wait_until(lambda: os.path.exists(flag), timeout=60):
        raise TimeoutError(flag)


def wait_then_return(flag: str) -> int:
    wait_for(flag)
    return 1


def flag_wait_then_fail(own_flag: str, flag: str):
    open(own_flag, "w").close()
    wait_for(flag)
    raise CustomError("the failure")


def flag_then_block(flag: str):
    open(flag, "w").close()
    time.sleep(60)  # killed by the abort


def test_a_reused_parallel_never_runs_tasks_left_over_by_a_failed_call(tmp_path):
    """As in a managed context, for a Parallel instance called again outside one."""
    failer, blocker = str(tmp_path / "failer-started"), str(tmp_path / "blocker-started")
    # pre_dispatch=2 sends the first two tasks. The first completes once the
    # second runs; joblib then prepares the next two batches and sends the
    # third, which lets the second fail while the fourth is still prepared.
    tasks = [delayed(wait_then_return)(failer), delayed(flag_wait_then_fail)(failer, blocker)]
    tasks += [delayed(flag_then_block)(blocker), delayed(fail)(CustomError("stale batch of the failed call"))]
    parallel = Parallel(n_jobs=2, batch_size=1, pre_dispatch="2")
    with pytest.raises(CustomError, match="the failure"):
        parallel(iter(tasks))
    assert parallel(delayed(square)(i) for i in range(3)) == [0, 1, 4]


def fail_on_none(x):
    if x is None:
        raise CustomError("planned")
    return x


def joblib_parallel_on_memshare(**kwargs):
    return joblib.Parallel(backend="memshare", **kwargs)


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "reused"])
@pytest.mark.parametrize("make", [Parallel, joblib_parallel_on_memshare], ids=["memshare", "joblib"])
def test_next_call_never_runs_tasks_prefetched_by_a_failed_call(make, managed):
    # With pre_dispatch=1 one task runs at a time and each completion
    # dispatches the next; joblib fetches n_jobs batches at once, so when the
    # second task fails the third (99) is always fetched but not dispatched.
    parallel = make(n_jobs=2, pre_dispatch=1, batch_size=1)
    with parallel if managed else contextlib.nullcontext():
        with pytest.raises(CustomError):
            parallel(delayed(fail_on_none)(x) for x in [0, None, 99, 98])
        assert parallel(delayed(fail_on_none)(x) for x in [1, 2, 3]) == [1, 2, 3]


def test_timeout_and_generators():
    with pytest.raises((TimeoutError, multiprocessing.TimeoutError)):  # joblib raises the latter
        Parallel(n_jobs=2, timeout=0.5)(delayed(slow)(i, 5) for i in range(2))
    gen = Parallel(n_jobs=2, return_as="generator")(delayed(square)(i) for i in range(10))
    assert list(gen) == [i * i for i in range(10)]


@pytest.mark.skipif("generator_unordered" not in RETURN_AS, reason="return_as='generator_unordered' needs joblib>=1.4")
def test_generator_unordered_yields_the_first_result_done():
    unordered = Parallel(n_jobs=2, return_as="generator_unordered")(
        delayed(slow)(i, s) for i, s in [(0, 1.5), (1, 0.0)]
    )
    assert next(unordered) == 1


def test_batch_size_and_pre_dispatch():
    out = Parallel(n_jobs=2, batch_size=7, pre_dispatch="all")(delayed(square)(i) for i in range(50))
    assert out == [i * i for i in range(50)]


def test_nested_calls_use_threads_not_processes():
    assert Parallel(n_jobs=2)(delayed(nested)(3) for _ in range(2)) == [[0, 1, 4]] * 2


def test_workers_are_reused_across_ten_calls():
    pids = [set(Parallel(n_jobs=2)(delayed(worker_pid)(i) for i in range(8))) for _ in range(10)]
    assert len(set().union(*pids)) <= 2


def test_managed_context_keeps_files_until_exit_and_sees_mutations(shm_dir):
    data = np.zeros(300_000)
    with Parallel(n_jobs=2) as parallel:
        assert parallel(delayed(total)(data) for _ in range(4)) == [0.0] * 4
        assert len(files_under(shm_dir)) == 1
        data[:] = 1.0
        assert parallel(delayed(total)(data) for _ in range(4)) == [300_000.0] * 4
        parallel(delayed(total)(data) for _ in range(4))
    assert memshare.last_call_stats()["arrays_dumped"] == 2  # once, then once more after the change
    assert memshare_entries(shm_dir) == []


def test_settings_change_takes_effect_without_restarting_workers(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    data = np.ones(300_000)
    seen, workers = [], []
    for folder in (first, second):
        seen.append(Parallel(n_jobs=2, temp_folder=str(folder))(delayed(worker_pid)(data) for _ in range(4)))
        assert folder.exists()  # the folder was used
        workers.append(_loky_workers())
    # The second call ran on workers that were there after the first (tiny tasks may all go to one of them).
    assert set(seen[1]) <= workers[0] and workers[1] == workers[0], (seen, workers)
    assert Parallel(n_jobs=2, max_nbytes=None)(delayed(kind)(data) for _ in range(2)) == ["ndarray"] * 2
    with joblib.parallel_config(max_nbytes="10M"):
        assert Parallel(n_jobs=2)(delayed(kind)(data) for _ in range(2)) == ["ndarray"] * 2


def _loky_workers() -> set:
    """The pids of this process's loky worker processes now."""
    return {
        child.pid
        for child in psutil.Process().children()
        if any("popen_loky_posix" in part for part in _cmdline(child))
    }


def _cmdline(process) -> list:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def test_two_threads_at_once_get_separate_folders(shm_dir):
    results = {}

    def run(name, value):
        data = np.full(300_000, value)
        results[name] = Parallel(n_jobs=2)(delayed(total)(data) for _ in range(6))

    threads = [threading.Thread(target=run, args=(n, float(n))) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {n: [300_000.0 * n] * 6 for n in range(2)}
    assert memshare_entries(shm_dir) == []


def test_joblib_parallel_config_selects_memshare(shm_dir):
    data = np.ones(300_000)
    with joblib.parallel_config(backend="memshare", n_jobs=2):
        assert joblib.Parallel()(delayed(kind)(data) for _ in range(2)) == ["memmap"] * 2
    assert memshare.last_call_stats()["arrays_dumped"] == 1


def test_other_backends_pass_through():
    assert Parallel(n_jobs=2, backend="threading")(delayed(square)(i) for i in range(4)) == [0, 1, 4, 9]
    with joblib.parallel_config(backend="threading"):
        parallel = Parallel(n_jobs=2)
        assert type(parallel._backend).__name__ == "ThreadingBackend"


def test_no_resource_tracker_noise_on_stderr():
    result = run_script(
        """
        import numpy as np
        from memshare import Parallel, delayed
        def f(x):
            return float(x.sum())
        def boom(x):
            raise ValueError(x)
        if __name__ == "__main__":
            data = np.ones(300_000)
            for _ in range(5):
                Parallel(n_jobs=2)(delayed(f)(data) for _ in range(4))
            Parallel(n_jobs=2, max_nbytes=None)(delayed(f)(data) for _ in range(2))
            try:
                Parallel(n_jobs=2)(delayed(boom)(1) for _ in range(2))
            except ValueError:
                pass
            with Parallel(n_jobs=2) as p:
                p(delayed(f)(data) for _ in range(2))
        """
    )
    for word in ("resource_tracker", "leaked", "KeyError", "FileNotFoundError", "Traceback"):
        assert word not in result.stderr, result.stderr


def thread_limits(_):
    return os.environ.get("OMP_NUM_THREADS"), os.environ.get("OPENBLAS_NUM_THREADS")


def test_blas_and_openmp_thread_limits_in_workers():
    expected = str(max(os.cpu_count() // 2, 1))
    if "OMP_NUM_THREADS" in os.environ:
        expected = os.environ["OMP_NUM_THREADS"]  # joblib keeps an explicit parent setting
    limits = set(Parallel(n_jobs=2)(delayed(thread_limits)(i) for i in range(4)))
    assert {omp for omp, _ in limits} == {expected}


def test_unpicklable_arguments_and_results_give_clear_errors(shm_dir):
    lock = threading.Lock()
    with pytest.raises(memshare.UnpicklableArgumentError, match="cannot send a call of square.*picklable"):
        Parallel(n_jobs=2)(delayed(square)(lock) for _ in range(2))
    with pytest.raises(TypeError):  # still a TypeError, as pickle's own error is
        with memshare.MemmappingPool(1) as pool:
            pool.apply(square, (lock,))
    with pytest.raises(memshare.UnpicklableResultError, match="cannot be pickled"):
        Parallel(n_jobs=2)(delayed(threading.Lock)() for _ in range(2))
    assert memshare_entries(shm_dir) == []


def write_and_sum(x):
    x[0] = 1.0  # fails on a read-only mapping
    return float(x.sum())


def test_parallel_config_settings_are_honoured(tmp_path):
    data = np.zeros(300_000)
    folder = tmp_path / "from-config"
    with joblib.parallel_config(temp_folder=str(folder), mmap_mode="c"):
        assert Parallel(n_jobs=2)(delayed(write_and_sum)(data) for _ in range(2)) == [1.0, 1.0]
        assert folder.is_dir() and memshare.last_call_stats()["arrays_dumped"] == 1
    assert data[0] == 0.0  # copy-on-write: the writes stayed in the workers
    with pytest.raises(ValueError, match="read-only"):
        Parallel(n_jobs=2)(delayed(write_and_sum)(data) for _ in range(2))  # default 'r'


def _thread_name(_):
    import threading

    return threading.current_thread().name, os.getpid()


@pytest.mark.parametrize("asks", [{"prefer": "threads"}, {"require": "sharedmem"}])
def test_a_call_that_asks_for_threads_gets_joblibs_threads(asks):
    ours = memshare.Parallel(n_jobs=2, **asks)(memshare.delayed(_thread_name)(i) for i in range(4))
    assert {pid for _, pid in ours} == {os.getpid()}  # threads of this process, as joblib.Parallel gives
    # Named explicitly, memshare's backend is still used for the rest.
    assert (
        memshare.Parallel(n_jobs=2, prefer="processes")(memshare.delayed(os.getpid)() for _ in range(2))
        != [os.getpid()] * 2
    )
