"""What a pool or call shared, as figures and as log lines.

Each session keeps a :class:`CallStats`. Decisions are logged on the
``memshare`` logger at DEBUG level, once per array; a one-line summary is
logged at INFO level when the session ends. ``MEMSHARE_DEBUG=1`` (or a
``verbose`` setting) turns the log on without configuring ``logging``.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass, field, fields
from typing import Dict, Optional

from . import _forksafe
from ._config import ENV_DEBUG, env_flag
from ._numpy import np

logger = logging.getLogger("memshare")

DUMPED = "dumped"
REFERENCED = "referenced"
PICKLED = "pickled"
REUSED = "reused"
HELD_ONCE = "held once"
NOT_HELD_ONCE = "not held once"
RETURNED_INPUT = "returned by reference to its input"


@dataclass
class CallStats:
    """Figures of one pool or call (a managed context counts as one).

    Arrays are counted once each, however many tasks use them, and so are
    out-of-band buffers (by their memory, once per call); ``tasks``
    counts submitted tasks (joblib batches and the chunks of a pool's ``map`` count as
    one task each).
    """

    arrays_dumped: int = 0
    bytes_dumped: int = 0
    dump_seconds: float = 0.0
    arrays_referenced: int = 0
    bytes_referenced: int = 0
    arrays_pickled: int = 0
    bytes_pickled: int = 0
    results_by_reference: int = 0
    bytes_results_by_reference: int = 0
    # Results that are memory the parent had in a file already, back with no copy and no new file:
    # views of an argument's dump or of an array held once (mapped copy-on-write), of a shared array, of a memmap.
    results_of_inputs: int = 0
    bytes_results_of_inputs: int = 0
    tasks: int = 0
    fallback_files: int = 0  # arrays and results written to the disk fallback
    arrays_held_once: int = 0  # arrays held once: their memory is now their shared file
    bytes_held_once: int = 0
    bytes_refreshed: int = 0  # bytes of arrays held once moved to a new file because the parent changed them
    results_pickled_no_room: int = 0  # results sent by value because no file had room
    buffers_dumped: int = 0  # out-of-band buffers of arguments written to shared memory (pyarrow's...)
    bytes_buffers_dumped: int = 0
    buffers_reused: int = 0  # such buffers of live Arrow objects whose file an earlier call wrote (kept)
    bytes_buffers_reused: int = 0
    buffers_pickled: int = 0  # out-of-band buffers of arguments kept in the task payloads: small
    bytes_buffers_pickled: int = 0
    objects_dumped: int = 0  # argument objects pickled once per call into shared memory (large dicts, models...)
    bytes_objects_dumped: int = 0
    # Shared memory memshare holds for this process right after the call, each file once: results
    # adopted and not freed (touched or not), dumps still alive, arrays held once, shared arrays,
    # kept buffers. Tools that sum RSS or PSS miss what no process touched; a cgroup counts all of it.
    bytes_in_shared_memory: int = 0
    _lock: threading.Lock = field(default_factory=_forksafe.lock, repr=False, compare=False)

    def as_dict(self) -> Dict[str, float]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def add_reference(self, nbytes: int) -> None:
        """One more array passed by reference: ``add`` for the per-task path of broadcasts, without its loop."""
        with self._lock:
            self.arrays_referenced += 1
            self.bytes_referenced += nbytes

    def summary(self) -> str:
        return (
            f"memshare: {self.tasks} tasks; {self.arrays_dumped} arrays dumped "
            f"({_mib(self.bytes_dumped)} in {self.dump_seconds:.2f} s), "
            f"{self.arrays_held_once} held once ({_mib(self.bytes_held_once)}), "
            f"{self.arrays_referenced} passed by reference ({_mib(self.bytes_referenced)}), "
            f"{self.arrays_pickled} pickled ({_mib(self.bytes_pickled)} of task payloads); "
            f"{self.buffers_dumped} buffers dumped ({_mib(self.bytes_buffers_dumped)}), "
            f"{self.buffers_reused} reused ({_mib(self.bytes_buffers_reused)}), "
            f"{self.buffers_pickled} pickled ({_mib(self.bytes_buffers_pickled)}); "
            f"{self.objects_dumped} argument objects pickled once ({_mib(self.bytes_objects_dumped)}); "
            f"{self.results_by_reference} results returned by reference "
            f"({_mib(self.bytes_results_by_reference)}), "
            f"{self.results_of_inputs} as memory the parent had ({_mib(self.bytes_results_of_inputs)}); "
            f"{_mib(self.bytes_in_shared_memory)} held in shared memory after the call"
        )


def _mib(nbytes: float) -> str:
    return f"{nbytes / 1024**2:.1f} MiB"


def describe(array: np.ndarray) -> str:
    return f"{_kind_of(array)} shape={tuple(array.shape)} dtype={array.dtype} size={_mib(array.nbytes)}"


def _kind_of(array: np.ndarray) -> str:
    """What ``array`` stands for in the log: an array, or a torch tensor or its storage (see ``_torch``)."""
    owner = array.base.base if isinstance(array.base, np.ndarray) else array.base
    if type(owner).__module__ != "torch":
        return "array"
    return "tensor storage" if owner is array.base else "tensor"


def describe_buffer(nbytes: int, exporter: object) -> str:
    return f"buffer of {type(exporter).__module__}.{type(exporter).__qualname__} size={_mib(nbytes)}"


def log_buffer_decision(
    decision: str, nbytes: int, exporter: object, where: Optional[str] = None, seconds: Optional[float] = None
) -> None:
    """Log what became of an out-of-band buffer of ``nbytes`` offered by ``exporter`` (once per call)."""
    if logger.isEnabledFor(logging.DEBUG):
        _log(describe_buffer(nbytes, exporter), decision, where, seconds)


def log_object_decision(
    decision: str, nbytes: int, obj: object, where: Optional[str] = None, seconds: Optional[float] = None
) -> None:
    """Log what became of an argument object whose pickle weighs ``nbytes`` (once per call)."""
    if logger.isEnabledFor(logging.DEBUG):
        what = f"argument object {type(obj).__module__}.{type(obj).__qualname__} pickled size={_mib(nbytes)}"
        _log(what, decision, where, seconds)


def log_decision(
    decision: str, array: np.ndarray, where: Optional[str] = None, seconds: Optional[float] = None
) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        _log(describe(array), decision, where, seconds)


def _log(what: str, decision: str, where: Optional[str], seconds: Optional[float]) -> None:
    text = f"{decision} {what}"
    if where:
        text += f" -> {where}"
    if seconds is not None:
        text += f" in {seconds * 1000:.1f} ms"
    logger.debug(text)


def enable_logging(level: int = logging.DEBUG) -> None:
    """Send memshare's log to stderr, unless logging is already configured for it."""
    logger.setLevel(level)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        logger.addHandler(handler)


if env_flag(ENV_DEBUG, False):
    enable_logging()


# The figures of the last finished call in this process, for last_call_stats().
# Module-level because "the last call" is a per-process notion.
_last: Optional[CallStats] = None
_last_lock = _forksafe.lock()


def record_finished(stats: CallStats) -> None:
    global _last
    with _last_lock:
        _last = stats
    logger.info(stats.summary())


def last_call_stats() -> Optional[Dict[str, float]]:
    """The figures of the last pool or call that finished in this process.

    Keys: ``arrays_dumped``, ``bytes_dumped``, ``dump_seconds``,
    ``arrays_referenced``, ``bytes_referenced``, ``arrays_pickled``,
    ``bytes_pickled``, ``results_by_reference``,
    ``bytes_results_by_reference`` (results that came back through a new
    shared file), ``results_of_inputs`` and ``bytes_results_of_inputs``
    (results that are memory the parent had in a file already, with no copy
    and no new file: a view of an argument's dump or of an array held once,
    mapped copy-on-write, or of a shared array or a memmap), ``tasks``, ``fallback_files`` (arrays
    and results written to the disk fallback because shared memory was
    full), ``results_pickled_no_room`` (results sent back by value because
    no file had room), ``arrays_held_once`` and ``bytes_held_once`` (arrays
    whose memory became their shared file in this call, see the manual's
    "Arrays held once"), ``bytes_refreshed`` (bytes of arrays held once moved to a
    new file because the parent changed them), ``buffers_dumped``
    and ``bytes_buffers_dumped`` (out-of-band buffers of arguments, such as
    pyarrow's behind Arrow-backed pandas columns, written once to shared
    memory), ``buffers_reused`` and ``bytes_buffers_reused`` (such buffers
    of Arrow objects still alive whose file an earlier call wrote: sent again
    after a comparison, not written), ``buffers_pickled`` and ``bytes_buffers_pickled`` (such
    buffers small enough to stay in the task payloads), ``objects_dumped``
    and ``bytes_objects_dumped`` (argument objects, such as a large dict,
    pickled once per call into shared memory instead of into every task's
    payload), ``bytes_in_shared_memory`` (the shared memory memshare holds
    for this process right after the call, each file once: results not
    freed yet, whether touched or not, dumps and kept buffers still alive,
    arrays held once, shared arrays; see the manual's "Memory that
    tools see"). None before the first call ends.

    A ``with Parallel() as p:`` context counts as one call, recorded when it
    ends. A sequential ``n_jobs=1`` call records no task.

    Returns
    -------
    dict or None
        Each key above with its count, bytes or seconds; None before the
        first pool or call of this process has finished.

    Examples
    --------
    >>> import numpy as np
    >>> import memshare
    >>> X = np.ones(1_000_000)  # 8 MB: above max_nbytes="1M"
    >>> _ = memshare.Parallel(n_jobs=2)(memshare.delayed(np.sum)(X) for _ in range(4))
    >>> stats = memshare.last_call_stats()
    >>> stats["tasks"], stats["arrays_dumped"] + stats["arrays_held_once"] + stats["arrays_referenced"] >= 1
    (4, True)
    """
    with _last_lock:
        return None if _last is None else _last.as_dict()
