"""The contenders that run a workload's tasks, and the parts of memshare's limit timed along with them.

A *contender* is a way of running a list of tasks in parallel: memshare's
``Parallel``, joblib's ``Parallel`` (with and without memmapping), a plain
``multiprocessing.Pool`` (everything pickled) or a serial loop; a
:class:`Runner` is one of them with its workers started and warmed. The
pools of workload (p) are contenders too (:data:`POOL_CONTENDERS`), run by
``workloads_pool`` rather than by a :class:`Runner`. The
limit's parts (:data:`LIMIT_PARTS`: one write of the data to ``/dev/shm``,
one first touch of it in a worker) are timed in the same rotation as the
contenders, through :func:`limit_part`.

Like the workload modules, this one is imported both from the package (by
the harness) and as a top-level module (by ``_contender.py``, which must not
import memshare), so it imports no other module of the package.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing as mp
import os
import uuid
from typing import Any, Callable, Iterator, List, Sequence, Tuple

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

PAGE = mmap.PAGESIZE
Task = Tuple[Callable[..., Any], tuple]


# Task functions: module level so that every contender can pickle them by reference.
def noop(x: Any) -> Any:
    """Trivial task used to start and warm workers."""
    return x


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


@contextlib.contextmanager
def limit_part(nbytes: int, data: Any, part: str) -> Iterator[Callable[[], Any]]:
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


def warm_backend(contender: str, n_jobs: int) -> None:
    """Start and warm the workers a ``parallel_config`` backend will use."""
    with runner(contender, n_jobs):
        pass
