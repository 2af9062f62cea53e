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

Besides arrays: pandas DataFrames backed by Arrow (j, k, m; skipped without
pandas and pyarrow), a large dict (l), and process pools on small items (p).
A workload with ``operations`` (the pools) is timed once per operation, each
in a session of its own (``custom_session``); the operations it lists in
``fresh_process`` are timed in a new contender process at every repeat, so
that nothing the first pool of a process started (a fork server, imported
modules) serves the next one.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing as mp
import operator
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

BASE_CONTENDERS: Tuple[str, ...] = ("memshare", "joblib", "joblib-nomemmap", "mp.Pool", "serial")
# "memshare-plain": memshare's Parallel handed a plain np.ndarray where the workload gives memshare a shared array.
# "memshare-copy": memshare with promote=False: a plain array is dumped (copied) instead of held once.
# "memshare-broadcast": memshare's Parallel handed memshare.broadcast(obj) (made inside the timed call).
# The pools of workload (p): memshare's and joblib's MemmappingPool, multiprocessing.Pool with two start methods.
POOL_CONTENDERS: Tuple[str, ...] = ("memshare-pool", "joblib-pool", "mp.Pool-forkserver", "mp.Pool-fork")
CONTENDERS: Tuple[str, ...] = (
    "memshare",
    "memshare-plain",
    "memshare-copy",
    "memshare-broadcast",
    "joblib",
    "joblib-nomemmap",
    "mp.Pool",
    "serial",
) + POOL_CONTENDERS
MEMSHARE_CONTENDERS = ("memshare", "memshare-plain", "memshare-copy", "memshare-broadcast")
PICKLING = ("joblib-nomemmap", "mp.Pool")
# Parts of the limit "serial / workers + one write + one first touch", timed in the same run as the contenders.
LIMIT_PARTS: Tuple[str, ...] = ("shm-write", "first-touch")
# memshare.last_call_stats() keys reported by default, and for data that is not an array (buffers, objects, payloads).
STAT_KEYS: Tuple[str, ...] = (
    "bytes_dumped",
    "dump_seconds",
    "arrays_held_once",
    "bytes_refreshed",
    "arrays_referenced",
    "results_by_reference",
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
    "results_by_reference",
    "bytes_results_by_reference",
)
PAGE = mmap.PAGESIZE
MiB = 1 << 20
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


def arrow_strings(nbytes: int, seed: int = 0) -> Any:
    """A ``pyarrow`` string array of random strings of 24 to 40 letters, about ``nbytes`` with its offsets.

    Built from its buffers directly (fast at any size). 32-bit offsets while they fit, as older pandas
    (before 2.2) take only those into ``string[pyarrow]``; newer pandas widens them to 64 bits, copying
    the offsets only.
    """
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    rows = max(1, nbytes // 36)  # 32 letters on average + a 4-byte offset
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(rng.integers(24, 41, size=rows, dtype=np.int64), out=offsets[1:])
    # 1 MiB of random letters repeated: strings at random offsets into it, as unlike each other as needed here,
    # at the speed of a copy.
    letters = np.resize(rng.integers(97, 123, size=min(int(offsets[-1]), MiB), dtype=np.uint8), int(offsets[-1]))
    if offsets[-1] < 2**31:
        return pa.StringArray.from_buffers(rows, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(letters))
    return pa.LargeStringArray.from_buffers(rows, pa.py_buffer(offsets), pa.py_buffer(letters))


def string_frame(nbytes: int, seed: int = 0) -> Any:
    """A DataFrame with one ``string[pyarrow]`` column of about ``nbytes``."""
    import pandas as pd
    import pyarrow as pa

    table = pa.table({"s": arrow_strings(nbytes, seed)})
    string = pd.StringDtype("pyarrow")
    return table.to_pandas(types_mapper={pa.string(): string, pa.large_string(): string}.get)


def frame_statistic(frame: Any, k: int) -> Any:
    """One cheap statistic of ``frame`` (which one depends on ``k``): the transport is what gets measured."""
    column = frame[frame.columns[k % len(frame.columns)]]
    which = k % 4
    if which == 0:
        return int(column.count())
    if which == 1:
        return str(column.iloc[(k * 1000) % len(column)])
    if which == 2:
        return int(column.isna().sum())
    return len(frame)


def lookup(table: Any, k: int) -> int:
    """Sum of 100 entries of a dict of ``key-<i>`` -> i (or of a ``memshare.Broadcast`` of one)."""
    table = table.value if type(table).__name__ == "Broadcast" else table
    return sum(table[f"key-{(k * 7919 + j) % len(table)}"] for j in range(100))


def increment(x: int) -> int:
    """The pools' task (p): ``x + 1``."""
    return x + 1


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

    ``custom_session(data, contender, n_jobs, operation)``, when set, replaces :meth:`session`'s
    own set-up: a context manager yielding the ``run()`` to time, for contenders that need
    their own warm-up and clean-up (the pools of (p)); with contender ``"serial"`` it gives
    the expected answer. ``operations`` names the separately timed operations of one
    workload (each gets rows of its own), ``fresh_process`` those of them timed in a new
    contender process at every repeat. ``reference`` is the contender the main table's
    ratios divide by; ``stat_keys`` the keys of ``memshare.last_call_stats()`` reported.
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
            if self.warm is not None:
                r.run(self.warm(n_jobs))
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


def _arrow_skip() -> Optional[str]:
    import importlib.util

    missing = [m for m in ("pandas", "pyarrow") if importlib.util.find_spec(m) is None]
    if missing:
        return f"needs {' and '.join(missing)}, not installed here (pip install pandas pyarrow)"
    return None


FRAME_TASKS = 8


def _arrow_dtype_frame(size: int, quick: bool) -> Any:
    """A string and a float column (4/5 and 1/6 of ``size``) through Parquet and back, with Arrow dtypes.

    Written to an in-memory Parquet file and read back as ``pd.read_parquet(..., dtype_backend="pyarrow")``
    would (``types_mapper=pd.ArrowDtype``): the chunked columns with validity bitmaps a frame read from a
    file has. Uncompressed and without dictionaries, so that building it stays quick.
    """
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    strings = arrow_strings(size * 4 // 5)
    floats = np.random.default_rng(1).random(len(strings))
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"s": strings, "f": floats}), sink, compression="none", use_dictionary=False)
    del strings, floats
    return pq.read_table(pa.BufferReader(sink.getvalue())).to_pandas(types_mapper=pd.ArrowDtype)


def _frame_tasks(frame: Any, pickles: bool) -> List[Task]:
    return [(frame_statistic, (frame, k)) for k in range(FRAME_TASKS)]


def _warm_strings(n_jobs: int) -> List[Task]:
    return [(frame_statistic, (string_frame(4000, k), k)) for k in range(2 * n_jobs)]


def _warm_arrow_dtypes(n_jobs: int) -> List[Task]:
    return [(frame_statistic, (_arrow_dtype_frame(4000, True), k)) for k in range(2 * n_jobs)]


def _warm_results(n_jobs: int) -> List[Task]:
    return [(string_frame, (4000, k)) for k in range(2 * n_jobs)]


def _frames_equal(result: Any, expected: Any) -> bool:
    return len(result) == len(expected) and all(
        a.equals(b) and list(a.dtypes) == list(b.dtypes) for a, b in zip(result, expected)
    )


# The dict of (l): its pickle weighs about size / DICT_SHARE (a str -> int entry pickles to about 17 bytes, and
# takes about 7 times that in memory); 40 tasks, 8 with --quick.
DICT_SHARE = 64
DICT_TASKS = 40
DICT_TASKS_QUICK = 8


def _dict_data(size: int, quick: bool) -> tuple:
    entries = max(1000, size // DICT_SHARE // 17)
    return {f"key-{i}": i for i in range(entries)}, DICT_TASKS_QUICK if quick else DICT_TASKS


def _dict_run(data: tuple, contender: str, n_jobs: int) -> List[int]:
    """The lookups of (l); memshare-broadcast broadcasts the dict inside the timed call, as a user would."""
    table, n_tasks = data
    if contender == "serial":
        return [lookup(table, k) for k in range(n_tasks)]
    argument = table
    if contender == "memshare-broadcast":
        import memshare

        argument = memshare.broadcast(table)
    return Runner(contender, n_jobs).run([(lookup, (argument, k)) for k in range(n_tasks)])


# The pools of (p): the start method each uses. memshare's MemmappingPool defaults to forkserver (where it
# exists); joblib's MemmappingPool, like multiprocessing.Pool, to the platform's default (the first listed).
POOL_OPERATIONS: Tuple[str, ...] = ("start", "map", "imap", "apply")
POOL_START_ITEMS = 100


def pool_start_method(contender: str) -> str:
    """The start method the pool contender ``contender`` starts its workers with."""
    methods = mp.get_all_start_methods()
    if contender == "memshare-pool":
        return "forkserver" if "forkserver" in methods else methods[0]
    if contender == "joblib-pool":
        return methods[0]
    return contender.rsplit("-", 1)[1]


class _SerialPool:
    """The pool interface run in the calling process: the expected answers of (p)."""

    def map(self, func: Callable[[Any], Any], items: Any) -> List[Any]:
        return [func(x) for x in items]

    imap = map

    def apply_async(self, func: Callable[..., Any], args: tuple) -> Any:
        value = func(*args)
        return type("Done", (), {"get": lambda self: value})()

    def terminate(self) -> None:
        pass

    def join(self) -> None:
        pass


def _new_pool(contender: str, n_jobs: int) -> Any:
    """A new pool of ``n_jobs`` workers; the pool's module is imported here (timed in "start")."""
    if contender == "serial":
        return _SerialPool()
    if contender == "memshare-pool":
        from memshare import MemmappingPool

        return MemmappingPool(n_jobs)
    if contender == "joblib-pool":
        from joblib.pool import MemmappingPool as JoblibPool

        return JoblibPool(n_jobs)
    return mp.get_context(pool_start_method(contender)).Pool(n_jobs)


@contextlib.contextmanager
def _pool_session(counts: Dict[str, int], contender: str, n_jobs: int, operation: str) -> Iterator[Callable[[], Any]]:
    """``run()`` for one operation of (p). "start" creates the pool and maps 100 items, timed; the others time
    their operation on a pool created and used once before (untimed). The pool is terminated on exit."""
    pools: List[Any] = []

    def start() -> List[int]:
        pools.append(_new_pool(contender, n_jobs))
        return pools[0].map(increment, range(POOL_START_ITEMS))

    def map_() -> List[int]:
        return pools[0].map(increment, range(counts["map"]))

    def imap() -> List[int]:
        return list(pools[0].imap(increment, range(counts["imap"])))

    def apply() -> List[int]:
        pending = [pools[0].apply_async(increment, (i,)) for i in range(counts["apply"])]
        return [result.get() for result in pending]

    runs = {"start": start, "map": map_, "imap": imap, "apply": apply}
    try:
        if operation != "start":
            start()
        yield runs[operation]
    finally:
        # terminate, as joblib's pool asks, so that it removes its temporary folder; then wait for the workers.
        for pool in pools:
            pool.terminate()
            pool.join()


def _pool_counts(size: int, quick: bool) -> Dict[str, int]:
    return {"map": 20_000, "imap": 2_000, "apply": 2_000}


def make_workloads() -> Dict[str, Workload]:
    """All workloads by key (a-m and p)."""
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
        "j": Workload(
            "j",
            f"Arrow strings: a DataFrame with one string[pyarrow] column of about the size, passed to "
            f"{FRAME_TASKS} tasks that each compute one cheap statistic of it (joblib pickles it into every task)",
            lambda size, quick: string_frame(size),
            _frame_tasks,
            contenders=("memshare", "joblib", "serial"),
            skip_reason=_arrow_skip,
            stat_keys=OBJECT_STAT_KEYS,
            warm=_warm_strings,
        ),
        "k": Workload(
            "k",
            f"Arrow dtypes: a DataFrame read from (in-memory) Parquet with types_mapper=pd.ArrowDtype, a string "
            f"and a float column of about the size in all, passed to {FRAME_TASKS} tasks each computing one "
            "statistic",
            _arrow_dtype_frame,
            _frame_tasks,
            contenders=("memshare", "joblib", "serial"),
            skip_reason=_arrow_skip,
            stat_keys=OBJECT_STAT_KEYS,
            warm=_warm_arrow_dtypes,
        ),
        "l": Workload(
            "l",
            f"large dict: str -> int whose pickle weighs about size/{DICT_SHARE}, passed to {DICT_TASKS} tasks "
            f"({DICT_TASKS_QUICK} with --quick) that each look up 100 keys; memshare-broadcast passes "
            "memshare.broadcast(dict), made inside the timed call",
            _dict_data,
            lambda data, pickles: [],
            contenders=("memshare", "memshare-broadcast", "joblib", "serial"),
            custom_run=_dict_run,
            stat_keys=OBJECT_STAT_KEYS,
        ),
        "m": Workload(
            "m",
            f"Arrow results: {FRAME_TASKS} tasks each build and return a string[pyarrow] DataFrame of size/"
            f"{FRAME_TASKS} (the building, in the workers, is the same for all)",
            lambda size, quick: max(40, size // FRAME_TASKS),
            lambda n, pickles: [(string_frame, (n, seed)) for seed in range(FRAME_TASKS)],
            contenders=("memshare", "joblib", "serial"),
            check=_frames_equal,
            skip_reason=_arrow_skip,
            stat_keys=OBJECT_STAT_KEYS,
            warm=_warm_results,
        ),
        "p": Workload(
            "p",
            "pools on small items, f(x) = x + 1: start = import the pool's module, create the pool and map "
            f"{POOL_START_ITEMS} items, in a new process at each repeat (numpy, which memshare and joblib import, "
            "already imported; a fork server imports that process's main module, which imports numpy, as it would "
            "a user's script); map(f, range(20000)); list(imap(f, range(2000))); 2000 apply_async then get, "
            "each on a pool created and used once before",
            _pool_counts,
            lambda data, pickles: [],
            contenders=tuple(c for c in POOL_CONTENDERS if pool_start_method(c) in mp.get_all_start_methods()),
            custom_session=_pool_session,
            operations=POOL_OPERATIONS,
            fresh_process=("start",),
            reference="joblib-pool",
            stat_keys=("tasks", "bytes_pickled"),
        ),
    }
