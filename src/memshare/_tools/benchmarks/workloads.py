"""The benchmark's workloads: what each one prepares, runs and checks, and the one registry of them all.

A *workload* builds its data once, knows the expected answer (computed
serially, outside any timing) and, for each contender (``runners``), yields a
``run()`` callable whose call is what gets timed. Workers are started and
warmed before ``run()`` is handed out, so a timed call measures the first
dispatch of the data to live workers ("cold") or, where the workload says so,
a repeated call ("warm").

Pickling contenders (``mp.Pool``, ``joblib-nomemmap``) get each task's own
slice where the task only needs a slice, which is how one uses a pickling
pool; when a task needs the whole array they must pickle it once per task, and
the harness skips them when that would exceed a budget.

The array workloads (a-i) are defined here; the data of those on other
objects, pandas DataFrames backed by Arrow (j, k, m; skipped without pandas
and pyarrow) and a large dict (l), comes from ``workloads_data``, the process
pools on small items (p) from ``workloads_pool``, and the tasks that return
their input, an array (q) or a torch tensor (r; skipped without torch), from
``workloads_returns``. :func:`make_workloads` declares them all. A workload
with ``operations`` (the pools) is timed once per operation, each in a session
of its own (``custom_session``); the operations it lists in ``fresh_process``
are timed in a new contender process at every repeat, so that nothing the
first pool of a process started (a fork server, imported modules) serves the
next one.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import numpy as np

# Sibling modules: relative imports from the package (the harness), top-level ones from _contender.py, which runs
# as a script from this folder and must not import memshare (see there).
if __package__:
    from .runners import BASE_CONTENDERS, LIMIT_PARTS, PICKLING, POOL_CONTENDERS, Task, limit_part, runner, warm_backend
    from .workloads_data import (
        DICT_SHARE,
        DICT_TASKS,
        DICT_TASKS_QUICK,
        FRAME_TASKS,
        arrow_dtype_frame,
        arrow_skip,
        dict_data,
        dict_run,
        frame_tasks,
        frames_equal,
        string_frame,
        warm_arrow_dtypes,
        warm_results,
        warm_strings,
    )
    from .workloads_pool import POOL_OPERATIONS, POOL_START_ITEMS, pool_counts, pool_session, pool_start_method
    from .workloads_returns import (
        RETURN_TASKS,
        return_tasks,
        returned_pickled_bytes,
        tensor_data,
        tensors_equal,
        torch_skip,
        warm_torch,
    )
else:
    from runners import BASE_CONTENDERS, LIMIT_PARTS, PICKLING, POOL_CONTENDERS, Task, limit_part, runner, warm_backend
    from workloads_data import (
        DICT_SHARE,
        DICT_TASKS,
        DICT_TASKS_QUICK,
        FRAME_TASKS,
        arrow_dtype_frame,
        arrow_skip,
        dict_data,
        dict_run,
        frame_tasks,
        frames_equal,
        string_frame,
        warm_arrow_dtypes,
        warm_results,
        warm_strings,
    )
    from workloads_pool import POOL_OPERATIONS, POOL_START_ITEMS, pool_counts, pool_session, pool_start_method
    from workloads_returns import (
        RETURN_TASKS,
        return_tasks,
        returned_pickled_bytes,
        tensor_data,
        tensors_equal,
        torch_skip,
        warm_torch,
    )

# memshare.last_call_stats() keys reported by default, and for data that is not an array (buffers, objects, payloads).
STAT_KEYS: Tuple[str, ...] = (
    "bytes_dumped",
    "dump_seconds",
    "arrays_held_once",
    "bytes_refreshed",
    "arrays_referenced",
    "results_by_reference",
    "results_of_inputs",
    "arrays_pickled",
)
OBJECT_STAT_KEYS: Tuple[str, ...] = (
    "tasks",
    "bytes_pickled",
    "buffers_dumped",
    "bytes_buffers_dumped",
    "buffers_pickled",
    "bytes_buffers_pickled",
    "objects_dumped",
    "bytes_objects_dumped",
    "buffers_reused",
    "bytes_buffers_reused",
    "results_by_reference",
    "bytes_results_by_reference",
)


# Task functions: module level so that every contender can pickle them by reference.
def chunk_sum(a: np.ndarray, start: int, stop: int) -> float:
    """Sum of ``a[start:stop]``."""
    return float(a[start:stop].sum())


def whole_sum(a: np.ndarray, i: int) -> float:
    """Sum of the whole array (``i`` only makes tasks distinct)."""
    return float(a.sum())


def make_full(n: int, value: float) -> np.ndarray:
    """A new array of ``n`` float64 filled with ``value``: a large result that must be created."""
    return np.full(n, value)


def fit_grid_search(X: np.ndarray, y: np.ndarray, n_jobs: int, backend: Optional[str], config: dict) -> tuple:
    """GridSearchCV of a Ridge regression over a small alpha grid, with cv=3."""
    import joblib
    from sklearn.linear_model import Ridge
    from sklearn.model_selection import GridSearchCV

    search = GridSearchCV(Ridge(), {"alpha": [0.1, 1.0, 10.0]}, cv=3, n_jobs=n_jobs)
    if backend is None:
        search.fit(X, y)
    else:
        with joblib.parallel_config(backend=backend, **config):
            search.fit(X, y)
    return (search.best_params_["alpha"], float(search.best_score_))


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return bool(np.isclose(a, b, rtol=1e-9, atol=1e-9))
    return a == b


#: A few words for each workload, for the picture's axis and the report's list of workloads, where the
#: whole title (:attr:`Workload.title`) would not fit.
SHORT_NAMES: Dict[str, str] = {
    "a": "chunks",
    "b": "whole scans",
    "c": "large results",
    "d": "tiny tasks",
    "e": "managed 2nd call",
    "f": "shared, 5 calls",
    "g": "GridSearchCV",
    "h": "n_jobs sweep",
    "i": "shared loop",
    "j": "Arrow strings",
    "k": "Arrow dtypes",
    "l": "large dict",
    "m": "Arrow results",
    "n": "Arrow 2nd call",
    "p": "pools",
    "q": "returned arrays",
    "r": "returned tensors",
}


@dataclass
class Workload:
    """One workload at one size.

    ``prepare(size, quick)`` builds the data; ``tasks(data, pickles)`` gives the
    task list (pickling contenders may get slices); ``pickled_bytes(data)`` is what a
    pickling contender would copy per call, for the harness's budget; ``calls`` is
    how many calls one timed run makes. ``select(data, contender)`` turns the prepared data
    into what a contender gets (workload (i): a shared copy for memshare, the plain array for
    the others); :meth:`prepare_for` does both, in the contender's own process.
    ``limit_bytes(data)``, when set, is the size written and first-touched by the limit's
    parts (:data:`LIMIT_PARTS`), which the harness then times along with the contenders.

    ``custom_session(data, contender, n_jobs, operation)``, when set, replaces :meth:`session`'s
    own set-up: a context manager yielding the ``run()`` to time, for contenders that need
    their own warm-up and clean-up (the pools of (p)); with contender ``"serial"`` it gives
    the expected answer. ``operations`` names the separately timed operations of one
    workload (each gets rows of its own), ``fresh_process`` those of them timed in a new
    contender process at every repeat. ``reference`` is the contender the main table's
    ratios divide by; ``stat_keys`` the keys of ``memshare.last_call_stats()`` reported.
    ``second_call`` runs the tasks once, untimed, as a call of their own, and times the second call.
    ``fresh_data`` builds the data anew for each repeat: memshare keeps the buffers of live Arrow
    data for later calls, so a frame reused across repeats would time the first repeat cold and the
    others warm.
    ``warm(n_jobs)``, when set, gives tiny tasks run once after the workers start, untimed,
    so that every worker imports what the timed tasks need (pandas and pyarrow, say) before
    the timing, as the noop tasks that start them do not.
    """

    key: str
    title: str
    prepare: Callable[[int, bool], Any]
    tasks: Callable[[Any, bool], List[Task]]
    contenders: Tuple[str, ...] = BASE_CONTENDERS
    pickled_bytes: Callable[[Any], int] = lambda data: 0
    managed_second_call: bool = False
    second_call: bool = False
    fresh_data: bool = False
    calls: int = 1
    check: Callable[[Any, Any], bool] = _close
    n_jobs_values: Tuple[int, ...] = ()
    note: str = ""
    custom_run: Optional[Callable[[Any, str, int], Any]] = None
    skip_reason: Callable[[], Optional[str]] = lambda: None
    extra: Dict[str, Any] = field(default_factory=dict)
    select: Callable[[Any, str], Any] = lambda data, contender: data
    limit_bytes: Optional[Callable[[Any], int]] = None
    # How the limit is made of its parts: "inputs" (the data goes to the workers: serial / workers + one write
    # + one first touch) or "results" (each worker makes and writes its own share of the results, which the
    # parent maps without reading: (serial + one write) / workers).
    limit_formula: str = "inputs"
    custom_session: Optional[Callable[[Any, str, int, str], ContextManager[Callable[[], Any]]]] = None
    operations: Tuple[str, ...] = ()
    fresh_process: Tuple[str, ...] = ()
    reference: str = "joblib"
    stat_keys: Tuple[str, ...] = STAT_KEYS
    warm: Optional[Callable[[int], List[Task]]] = None

    @property
    def short(self) -> str:
        """The workload in a few words (:data:`SHORT_NAMES`)."""
        return SHORT_NAMES.get(self.key, self.key)

    def prepare_for(self, size: int, quick: bool, contender: str) -> Any:
        """The data ``contender`` gets, built in its own process."""
        return self.select(self.prepare(size, quick), contender)

    def expected(self, data: Any, operation: str = "") -> Any:
        """The answer, computed serially outside any timing."""
        if self.custom_session is not None:
            with self.custom_session(data, "serial", 1, operation) as run:
                return run()
        if self.custom_run is not None:
            return self.custom_run(data, "serial", 1)
        return [func(*args) for func, args in self.tasks(data, False)]

    @contextlib.contextmanager
    def session(self, data: Any, contender: str, n_jobs: int, operation: str = "") -> Iterator[Callable[[], Any]]:
        """Live, warmed workers for ``contender``; yields the ``run()`` callable to time (of ``operation``)."""
        if self.custom_session is not None:
            with self.custom_session(data, contender, n_jobs, operation) as run:
                yield run
            return
        if contender in LIMIT_PARTS:
            with limit_part(self.limit_bytes(data), data, contender) as run:
                yield run
            return
        if self.custom_run is not None:
            custom = self.custom_run
            with runner("serial", 1) if contender == "serial" else contextlib.nullcontext():
                if contender != "serial":
                    warm_backend(contender, n_jobs)
                yield lambda: custom(data, contender, n_jobs)
            return
        tasks = self.tasks(data, contender in PICKLING)
        with runner(contender, n_jobs) as r:
            if self.warm is not None:
                r.run(self.warm(n_jobs))
            if self.managed_second_call:
                r.managed()
                r.run(tasks)  # the first call, untimed: the second one is measured
            elif self.second_call:
                r.run(tasks)  # the first call, untimed, of its own: the second one is measured
            if self.calls == 1:
                yield lambda: r.run(tasks)
            else:
                yield lambda: [r.run(tasks) for _ in range(self.calls)][-1]


def fresh(data: Any) -> Any:
    """A new copy of an ordinary array, else ``data`` itself: each repeat sends an array no call has seen.

    memshare holds an array once after its first call (its memory becomes its
    shared file), so reusing one array across repeats would time the first
    repeat cold and the others warm. Shared arrays (not owning their memory)
    and other data are used as they are.
    """
    if type(data) is np.ndarray and data.flags.owndata:
        renewed = data.copy(order="K")
        del data
        return renewed
    return data


def _array(size: int, quick: bool) -> np.ndarray:
    n = max(64, size // 8)
    rng = np.random.default_rng(0)
    return rng.random(n)


def _chunks(a: np.ndarray, pickles: bool, n_tasks: int = 64) -> List[Task]:
    bounds = np.linspace(0, a.size, n_tasks + 1).astype(int)
    if pickles:
        return [(chunk_sum, (a[lo:hi], 0, hi - lo)) for lo, hi in zip(bounds[:-1], bounds[1:])]
    return [(chunk_sum, (a, int(lo), int(hi))) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _shared_array(size: int, quick: bool) -> Any:
    import memshare

    return memshare.share(_array(size, quick))


def _shared_for_memshare(a: np.ndarray, contender: str) -> np.ndarray:
    """A shared copy for memshare, made before any timing (so before the memory baseline); others get ``a``."""
    if contender != "memshare":
        return a
    import memshare

    return memshare.share(a)


def _shared_skip() -> Optional[str]:
    import memshare

    if not hasattr(memshare, "share"):
        return "memshare.share does not exist yet (memshare/arrays.py)"
    return None


def _grid_data(size: int, quick: bool) -> tuple:
    n_features = 50
    n_samples = max(300, size // 8 // n_features)
    rng = np.random.default_rng(0)
    X = rng.random((n_samples, n_features))
    y = X @ rng.random(n_features) + 0.1 * rng.standard_normal(n_samples)
    return X, y


def _grid_run(data: tuple, contender: str, n_jobs: int) -> tuple:
    X, y = data
    if contender == "serial":
        return fit_grid_search(X, y, 1, None, {})
    backend = {"memshare": "memshare", "joblib": "loky", "joblib-nomemmap": "loky"}[contender]
    config = {"max_nbytes": None} if contender == "joblib-nomemmap" else {}
    return fit_grid_search(X, y, n_jobs, backend, config)


def _grid_check(result: tuple, expected: tuple) -> bool:
    return result[0] == expected[0] and bool(np.isclose(result[1], expected[1], rtol=1e-6))


def _tiny(size: int, quick: bool) -> int:
    return 1_000 if quick else 10_000


def make_workloads() -> Dict[str, Workload]:
    """All workloads by key (a-n, p, q and r)."""
    arrow_strings = Workload(
        "j",
        f"Arrow strings: a DataFrame with one string[pyarrow] column of about the size, passed to "
        f"{FRAME_TASKS} tasks that each compute one cheap statistic of it (joblib pickles it into every task)",
        lambda size, quick: string_frame(size),
        frame_tasks,
        contenders=("memshare", "joblib", "serial"),
        skip_reason=arrow_skip,
        stat_keys=OBJECT_STAT_KEYS,
        warm=warm_strings,
        fresh_data=True,
    )
    returned_input = Workload(
        "q",
        f"returned inputs: {RETURN_TASKS} tasks are each given the array X and return it (memshare gives the parent "
        "X's own file, held once (memshare) or dumped (memshare-copy), mapped copy-on-write for each result; the "
        "others send each result back whole)",
        _array,
        return_tasks,
        contenders=("memshare", "memshare-copy", "joblib", "mp.Pool", "serial"),
        pickled_bytes=returned_pickled_bytes,
    )
    return {
        "a": Workload(
            "a",
            "contiguous chunks: 64 tasks each sum 1/64 of the array (cold: first dispatch)",
            _array,
            _chunks,
            contenders=BASE_CONTENDERS + ("memshare-copy",),
            note="pickling contenders are sent only their chunk",
            limit_bytes=lambda a: a.nbytes,
        ),
        "b": Workload(
            "b",
            "whole scans: 16 tasks each sum the whole array",
            _array,
            lambda a, pickles: [(whole_sum, (a, i)) for i in range(16)],
            contenders=BASE_CONTENDERS + ("memshare-copy",),
            pickled_bytes=lambda a: 16 * a.nbytes,
            limit_bytes=lambda a: a.nbytes,
        ),
        "c": Workload(
            "c",
            "large results: 8 tasks each return a new array of size/8",
            lambda size, quick: max(8, size // 8 // 8),
            lambda n, pickles: [(make_full, (n, float(i))) for i in range(8)],
            limit_bytes=lambda n: 8 * n * 8,
            limit_formula="results",
        ),
        "d": Workload(
            "d",
            "many tiny tasks: operator.add(i, 1)",
            _tiny,
            lambda n, pickles: [(operator.add, (i, 1)) for i in range(n)],
        ),
        "e": Workload(
            "e",
            "managed second call: `with Parallel() as p`, workload (a) twice, second call timed",
            _array,
            _chunks,
            contenders=BASE_CONTENDERS + ("memshare-copy",),
            managed_second_call=True,
            note="memshare checks the array for changes; joblib reuses its dump without checking",
        ),
        "f": Workload(
            "f",
            "shared array (memshare.share): 5 calls of workload (a) in a loop",
            _shared_array,
            _chunks,
            contenders=("memshare", "joblib", "serial"),
            calls=5,
            skip_reason=_shared_skip,
        ),
        "g": Workload(
            "g",
            "scikit-learn GridSearchCV(Ridge, 3 alphas, cv=3) under parallel_config(backend=...)",
            _grid_data,
            lambda data, pickles: [],
            contenders=("memshare", "joblib", "joblib-nomemmap", "serial"),
            pickled_bytes=lambda data: 9 * data[0].nbytes,
            custom_run=_grid_run,
            check=_grid_check,
        ),
        "h": Workload(
            "h",
            "n_jobs sweep of workload (a)",
            _array,
            _chunks,
            contenders=("memshare", "joblib"),
            n_jobs_values=(1, 2, 4, 8),
        ),
        "i": Workload(
            "i",
            "shared-array loop: 10 separate calls of workload (a) over the same array; memshare gets "
            "memshare.share(array) (made before the memory baseline), joblib, memshare-plain and memshare-copy "
            "a plain np.ndarray",
            _array,
            _chunks,
            contenders=("memshare", "memshare-plain", "memshare-copy", "joblib", "serial"),
            calls=10,
            skip_reason=_shared_skip,
            select=_shared_for_memshare,
        ),
        "j": arrow_strings,
        "k": Workload(
            "k",
            f"Arrow dtypes: a DataFrame read from (in-memory) Parquet with types_mapper=pd.ArrowDtype, a string "
            f"and a float column of about the size in all, passed to {FRAME_TASKS} tasks each computing one "
            "statistic",
            arrow_dtype_frame,
            frame_tasks,
            contenders=("memshare", "joblib", "serial"),
            skip_reason=arrow_skip,
            stat_keys=OBJECT_STAT_KEYS,
            warm=warm_arrow_dtypes,
            fresh_data=True,
        ),
        "l": Workload(
            "l",
            f"large dict: str -> int whose pickle weighs about size/{DICT_SHARE}, passed to {DICT_TASKS} tasks "
            f"({DICT_TASKS_QUICK} with --quick) that each look up 100 keys; memshare-broadcast passes "
            "memshare.broadcast(dict), made inside the timed call",
            dict_data,
            lambda data, pickles: [],
            contenders=("memshare", "memshare-broadcast", "joblib", "serial"),
            custom_run=dict_run,
            stat_keys=OBJECT_STAT_KEYS,
        ),
        "m": Workload(
            "m",
            f"Arrow results: {FRAME_TASKS} tasks each build and return a string[pyarrow] DataFrame of size/"
            f"{FRAME_TASKS} (the building, in the workers, is the same for all)",
            lambda size, quick: max(40, size // FRAME_TASKS),
            lambda n, pickles: [(string_frame, (n, seed)) for seed in range(FRAME_TASKS)],
            contenders=("memshare", "joblib", "serial"),
            check=frames_equal,
            skip_reason=arrow_skip,
            stat_keys=OBJECT_STAT_KEYS,
            warm=warm_results,
        ),
        "n": replace(
            arrow_strings,
            key="n",
            title="Arrow strings, second call: workload (j) run twice as separate calls over the same frame, the "
            "second one timed (memshare sends again the buffers its first call wrote, once it compared them)",
            second_call=True,
        ),
        "p": Workload(
            "p",
            "pools on small items, f(x) = x + 1: start = import the pool's module, create the pool and map "
            f"{POOL_START_ITEMS} items, in a new process at each repeat (numpy, which memshare and joblib import, "
            "already imported; a fork server imports that process's main module, which imports numpy, as it would "
            "a user's script); map(f, range(20000)); list(imap(f, range(2000))); 2000 apply_async then get, "
            "each on a pool created and used once before",
            pool_counts,
            lambda data, pickles: [],
            contenders=tuple(c for c in POOL_CONTENDERS if pool_start_method(c) in mp.get_all_start_methods()),
            custom_session=pool_session,
            operations=POOL_OPERATIONS,
            fresh_process=("start",),
            reference="joblib-pool",
            stat_keys=("tasks", "bytes_pickled"),
        ),
        "q": returned_input,
        "r": replace(
            returned_input,
            key="r",
            title=f"returned input tensors: workload (q) with X a float64 torch tensor, each of the {RETURN_TASKS} "
            "tasks returning it (mp.Pool: torch's own reductions for multiprocessing, which move X and each result "
            "into shared memory; joblib: torch's pickle, X copied into every task and each result back)",
            prepare=tensor_data,
            check=tensors_equal,
            skip_reason=torch_skip,
            warm=warm_torch,
            fresh_data=True,
        ),
    }
