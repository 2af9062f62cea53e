"""The process pools of workload (p) on small items: each pool, its start method, and its timed operations.

:func:`pool_session` yields the ``run()`` of one operation ("start", "map",
"imap", "apply") on one pool, the pool created (and, for all but "start",
used once) outside the timing and terminated on exit; with contender
``"serial"`` the same operations run in the calling process and give the
expected answers. The workload itself is declared in
``workloads.make_workloads``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from typing import Any, Callable, Dict, Iterator, List, Tuple

# The pools of (p): the start method each uses. memshare's MemmappingPool defaults to forkserver (where it
# exists); joblib's MemmappingPool, like multiprocessing.Pool, to the platform's default (the first listed).
POOL_OPERATIONS: Tuple[str, ...] = ("start", "map", "imap", "apply")
POOL_START_ITEMS = 100


def increment(x: int) -> int:
    """The pools' task (p): ``x + 1``."""
    return x + 1


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
def pool_session(counts: Dict[str, int], contender: str, n_jobs: int, operation: str) -> Iterator[Callable[[], Any]]:
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


def pool_counts(size: int, quick: bool) -> Dict[str, int]:
    return {"map": 20_000, "imap": 2_000, "apply": 2_000}
