"""One session's side of holding arrays once: each array looked at once per call, not once per task."""

from __future__ import annotations

import time
from typing import Optional, Tuple

from .._numpy import np
from .._stats import HELD_ONCE, NOT_HELD_ONCE, CallStats, log_decision
from .._transport._identity import IdentityTable
from ._held_once import Held, HeldFile, forget, hold, lookup, unfit_reason


class SessionHolds:
    """One session's arrays held once: each array is held or refreshed once per generation, not once per task.

    Remembers, per array, the generation in which its file was last brought
    up to date and the one in which it was last refused (the reason logged
    then, once per call). Not thread-safe on its own: the session calls it
    with its lock held.
    """

    def __init__(self, stats: CallStats) -> None:
        self._stats = stats
        self._refreshed: IdentityTable[int] = IdentityTable()
        self._refused: IdentityTable[int] = IdentityTable()

    def hold(
        self, array: np.ndarray, generation: int, worker_mode: str, temp_folder: Optional[str]
    ) -> Optional[Tuple[Held, HeldFile]]:
        """``array``'s record and its file, current for ``generation``, acquired for one task; None: dump it.

        An array is held once the first time, brought up to date once per
        generation after that (a new file if it changed), and refused
        (dumped) when it cannot be held once or its pages cannot be read.
        One held by an earlier call is used whatever ``temp_folder``. The
        caller releases the file (:meth:`Held.release`) when the task is
        done. ``worker_mode`` must be one of ``_routes.SAFE_MODES``.
        """
        if self._refused.get(array) == generation:
            return None
        held = lookup(array)
        if held is None:
            reason = unfit_reason(array, worker_mode, temp_folder)
            if reason is None:
                try:
                    held, seconds = hold(array)
                except OSError as exc:
                    reason = f"{exc.strerror or exc}"
            if held is None:
                self.refuse(array, generation, reason)
                return None
            self._stats.add(arrays_held_once=1, bytes_held_once=array.nbytes, dump_seconds=seconds)
            log_decision(HELD_ONCE, array, held.ref.path, seconds)
            self._refreshed.add(array, generation)
        elif self._refreshed.get(array) != generation:
            started = time.perf_counter()
            try:
                rewritten = held.refresh(array)
            except OSError as exc:
                forget(array)  # part of it maps the unfinished file: never trusted again
                self.refuse(array, generation, f"its new file could not be written: {exc.strerror or exc}")
                return None
            if rewritten is None:
                if not held.describes(array):
                    forget(array)  # its memory moved (ndarray.resize): a plain array again
                self.refuse(array, generation, "its memory moved, or its pages' flags cannot be read")
                return None
            if rewritten:
                seconds = time.perf_counter() - started
                self._stats.add(bytes_refreshed=rewritten, dump_seconds=seconds)
                log_decision(HELD_ONCE, array, f"{held.ref.path} (changed since its last file)", seconds)
            self._refreshed.add(array, generation)
        return held, held.acquire()

    def refuse(self, array: np.ndarray, generation: int, reason: str) -> None:
        """``array`` is dumped, not held once, in ``generation`` because of ``reason`` (logged once per generation)."""
        if self._refused.get(array) != generation:
            self._refused.add(array, generation)
            log_decision(NOT_HELD_ONCE, array, f"dumped instead: {reason}")

    def clear(self) -> None:
        self._refreshed.clear()
        self._refused.clear()
