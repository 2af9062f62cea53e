"""Benchmark workloads and the contenders that run them.

A *contender* is a way of running a list of tasks in parallel: memshare's
``Parallel``, joblib's ``Parallel`` (with and without memmapping), a plain
``multiprocessing.Pool`` (everything pickled) or a serial loop. A *workload*
builds its data once, knows the expected answer (computed serially, outside
any timing) and, for each contender, yields a ``run()`` callable whose call is
what gets timed. Workers are started and warmed before ``run()`` is handed
out, so a timed call measures the first dispatch of the data to live workers
("cold") or, where the workload says so, a repeated call ("warm").

Pickling contenders (``mp.Pool``, ``joblib-nomemmap``) get each task's own
slice where the task only needs a slice, which is how one uses a pickling
pool; when a task needs the whole array they must pickle it once per task, and
the harness skips them when that would exceed a budget.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing as mp
import operator
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

BASE_CONTENDERS: Tuple[str, ...] = ("memshare", "joblib", "joblib-nomemmap", "mp.Pool", "serial")
# "memshare-plain": memshare's Parallel handed a plain np.ndarray where the workload gives memshare a shared array.
# "memshare-copy": memshare with promote=False: a plain array is dumped (copied) instead of held once.
CONTENDERS: Tuple[str, ...] = (
    "memshare",
    "memshare-plain",
    "memshare-copy",
    "joblib",
    "joblib-nomemmap",
    "mp.Pool",
    "serial",
)
MEMSHARE_CONTENDERS = ("memshare", "memshare-plain", "memshare-copy")
PICKLING = ("joblib-nomemmap", "mp.Pool")
# Parts of the limit "serial / workers + one write + one first touch", timed in the same run as the contenders.
LIMIT_PARTS: Tuple[str, ...] = ("shm-write", "first-touch")
PAGE = mmap.PAGESIZE
Task = Tuple[Callable[..., Any], tuple]


# Task functions: module level so that every contender can pickle them by reference.
def noop(x: Any) -> Any:
    """Trivial task used to start and warm workers."""
    return x


def chunk_sum(a: np.ndarray, start: int, stop: int) -> float:
    """Sum of ``a[start:stop]``."""
    return float(a[start:stop].sum())


def whole_sum(a: np.ndarray, i: int) -> float:
    """Sum of the whole array (``i`` only makes tasks distinct)."""
    return float(a.sum())


def make_full(n: int, value: float) -> np.ndarray:
    """A new array of ``n`` float64 filled with ``value``: a large result that must be created."""
    return np.full(n, value)


def touch_pages(path: str) -> int:
    """Map ``path`` read-only and read one byte of every page once: the page faults of a worker's first touch."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
            view = np.frombuffer(m, dtype=np.uint8)
            total = int(view[::PAGE].sum(dtype=np.int64))
            del view
    return total


def write_fresh(path: str, buffer: memoryview) -> None:
    """Write ``buffer`` into a new file with plain ``write()`` calls (as large as the kernel takes)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        done = 0
        while done < len(buffer):
            done += os.write(fd, buffer[done:])
    finally:
        os.close(fd)


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


# Contenders -----------------------------------------------------------------------------------------------------


class Runner:
    """A contender with live workers: ``run(tasks)`` returns the list of results in order."""

    def __init__(self, name: str, n_jobs: int) -> None:
        self.name = name
        self.n_jobs = n_jobs
        self._pool = None
        self._managed = None

    @property
    def pickles(self) -> bool:
        """True when this contender pickles array arguments into every task."""
        return self.name in PICKLING

    def _parallel(self, **extra):
        import joblib

        if self.name in MEMSHARE_CONTENDERS:
            import memshare  # only here: the other contenders' processes never import it

            backend = memshare.MemshareBackend(promote=False) if self.name == "memshare-copy" else "memshare"
            return memshare.Parallel(n_jobs=self.n_jobs, backend=backend, **extra)
        if self.name == "joblib":
            return joblib.Parallel(n_jobs=self.n_jobs, **extra)
        if self.name == "joblib-nomemmap":
            return joblib.Parallel(n_jobs=self.n_jobs, max_nbytes=None, **extra)
        raise ValueError(self.name)

    def start(self) -> None:
        """Start the workers and run a trivial call so that timing excludes process start-up."""
        if self.name == "mp.Pool":
            self._pool = mp.get_context("spawn").Pool(self.n_jobs)
        self.run([(noop, (i,)) for i in range(4 * self.n_jobs)])

    def close(self) -> None:
        """Stop the workers this runner owns (loky's reusable workers stay, as in real use)."""
        if self._managed is not None:
            self._managed.__exit__(None, None, None)
            self._managed = None
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def run(self, tasks: Sequence[Task]) -> List[Any]:
        """Run tasks, in a managed ``Parallel`` context if :meth:`managed` was entered."""
        if self.name == "serial":
            return [func(*args) for func, args in tasks]
        if self.name == "mp.Pool":
            if len(set(func for func, _ in tasks)) == 1:
                return self._pool.starmap(tasks[0][0], [args for _, args in tasks])
            return [result.get() for result in [self._pool.apply_async(f, a) for f, a in tasks]]
        from joblib import delayed

        parallel = self._managed if self._managed is not None else self._parallel()
        return parallel(delayed(func)(*args) for func, args in tasks)

    def managed(self) -> None:
        """Enter ``with Parallel() as p:`` so later calls reuse one managed context (joblib contenders only)."""
        if self.name in MEMSHARE_CONTENDERS + ("joblib", "joblib-nomemmap"):
            self._managed = self._parallel()
            self._managed.__enter__()


@contextlib.contextmanager
def runner(name: str, n_jobs: int) -> Iterator[Runner]:
    """A started :class:`Runner`, closed on exit."""
    r = Runner(name, n_jobs)
    try:
        r.start()
        yield r
    finally:
        r.close()


# Workloads ------------------------------------------------------------------------------------------------------


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return bool(np.isclose(a, b, rtol=1e-9, atol=1e-9))
    return a == b


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
    """

    key: str
    title: str
    prepare: Callable[[int, bool], Any]
    tasks: Callable[[Any, bool], List[Task]]
    contenders: Tuple[str, ...] = BASE_CONTENDERS
    pickled_bytes: Callable[[Any], int] = lambda data: 0
    managed_second_call: bool = False
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

    def prepare_for(self, size: int, quick: bool, contender: str) -> Any:
        """The data ``contender`` gets, built in its own process."""
        return self.select(self.prepare(size, quick), contender)

    def expected(self, data: Any) -> Any:
        """The answer, computed serially outside any timing."""
        if self.custom_run is not None:
            return self.custom_run(data, "serial", 1)
        return [func(*args) for func, args in self.tasks(data, False)]

    @contextlib.contextmanager
    def session(self, data: Any, contender: str, n_jobs: int) -> Iterator[Callable[[], Any]]:
        """Live, warmed workers for ``contender``; yields the ``run()`` callable to time."""
        if contender in LIMIT_PARTS:
            with _limit_part(self.limit_bytes(data), data, contender) as run:
                yield run
            return
        if self.custom_run is not None:
            custom = self.custom_run
            with runner("serial", 1) if contender == "serial" else contextlib.nullcontext():
                if contender != "serial":
                    _warm_backend(contender, n_jobs)
                yield lambda: custom(data, contender, n_jobs)
            return
        tasks = self.tasks(data, contender in PICKLING)
        with runner(contender, n_jobs) as r:
            if self.managed_second_call:
                r.managed()
                r.run(tasks)  # the first call, untimed: the second one is measured
            if self.calls == 1:
                yield lambda: r.run(tasks)
            else:
                yield lambda: [r.run(tasks) for _ in range(self.calls)][-1]


@contextlib.contextmanager
def _limit_part(nbytes: int, data: Any, part: str) -> Iterator[Callable[[], Any]]:
    """``run()`` for one part of the limit; set-up (buffer, fresh file, warm worker) and clean-up are untimed.

    ``"shm-write"``: write the data (or ``nbytes`` of zeros when the data is not an array) once into a fresh
    ``/dev/shm`` file. ``"first-touch"``: in a started worker process, map a freshly written file of
    ``nbytes`` and read every page once.
    """
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    import tempfile

    path = os.path.join(folder or tempfile.gettempdir(), f"bench-limit-{os.getpid()}-{uuid.uuid4().hex}")
    if isinstance(data, np.ndarray) and data.nbytes == nbytes and data.flags.c_contiguous:
        buffer = memoryview(data).cast("B")
    else:
        buffer = memoryview(np.zeros(nbytes, dtype=np.uint8))
    pool = None
    try:
        if part == "shm-write":
            yield lambda: write_fresh(path, buffer)
        else:
            pool = mp.get_context("spawn").Pool(1)
            pool.apply(noop, (0,))
            write_fresh(path, buffer)
            del buffer
            yield lambda: pool.apply(touch_pages, (path,))
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _warm_backend(contender: str, n_jobs: int) -> None:
    """Start and warm the workers a ``parallel_config`` backend will use."""
    with runner(contender, n_jobs):
        pass


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
    """All workloads by key (a-i)."""
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
    }
